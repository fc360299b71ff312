"""Start the job's processes: Lightning's launcher, after :func:`~dynmo_lightning.strategy.checks.check_job`.

Under torchrun or SLURM, where every process is started from outside, each process runs the same checks in set-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from dynmo_lightning.pipeline.checkpoint.resume import with_resume_path
from dynmo_lightning.pipeline.elastic.lifetimes import end_world_at_exit
from dynmo_lightning.strategy.checks import check_job


class PipelineLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, with :func:`check_job` run before any worker starts.

    A job its manager restarted (torchrun's elastic agent, Slurm requeue) resumes ``fit`` from the newest complete
    checkpoint of the run (``auto_resume``, :mod:`~dynmo_lightning.pipeline.checkpoint.resume`).

    Args:
        strategy: the ``DynMoStrategy`` (its settings are read when the Trainer launches).
    """

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        end_world_at_exit()
        if trainer is not None:
            try:
                check_job(self._strategy, trainer, *args)
            except Exception as e:
                e.refused_before_launch = True  # type: ignore[attr-defined]  # front ends report it in one line
                raise
            if self._strategy.settings.auto_resume:
                args, kwargs = with_resume_path(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)
