"""CostTrace: write every profiled step's per-layer costs to ``costs.jsonl`` (for the simulator and the plots).

One JSON object per line: ``{"step", "fwd", "bwd", "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes",
"bwd_input", "bwd_weight", "layers_per_stage", "world_size", "changed_layers"}`` with per-layer lists (seconds per
micro-batch, bytes; ``bwd = bwd_input + bwd_weight``, the weight part measured apart under zero-bubble schedules),
and the layers a dynamics callback changed just before the step (recorded on profiled steps only: profile every step to
keep every event). It shares the profiler
with :class:`~dynmo_lightning.callbacks.DynMoBalancer`: a step either of them profiles is measured once and seen
by both.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.balance import CostTracker
from dynmo_lightning.core.control import Rebalancing, pipeline_control


class CostTrace(Callback):
    """Profile every ``every_n_steps`` steps and append the measurements to ``path`` (global rank 0 writes).

    Args:
        path: the ``costs.jsonl`` file.
        every_n_steps: profiling interval.
    """

    def __init__(self, path: str, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"profile.every_n_steps={every_n_steps} must be >= 1")
        self.path = path
        self.every_n_steps = every_n_steps

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> Rebalancing:
        control = pipeline_control(trainer, Rebalancing)
        if control is None:
            raise TypeError("profile.trace needs strategy=DynMoStrategy (it measures the pipeline's layers)")
        return control

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy(trainer)
        if trainer.is_global_zero and stage == "fit":
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            open(self.path, "w").close()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if trainer.global_step % self.every_n_steps == 0:
            self._strategy(trainer).request_profile()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (trainer.global_step - 1) % self.every_n_steps:
            return
        strategy = self._strategy(trainer)
        measured = strategy.profile_results()
        if measured is None or not trainer.is_global_zero:
            return
        record: dict[str, Any] = {"step": trainer.global_step - 1}
        # The backward's input and weight parts too (zero-bubble schedules schedule them apart; see profiling).
        for field in (*CostTracker.FIELDS, "bwd_input", "bwd_weight"):
            record[field] = [measured[i].get(field, 0.0) for i in range(len(measured))]
        record["layers_per_stage"] = strategy.layers_per_stage
        record["world_size"] = trainer.world_size
        # Layers a dynamic changed just before this step (the balancer reacts to them; the simulator replays it).
        record["changed_layers"] = strategy.changed_layers(record["step"])
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
