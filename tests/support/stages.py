"""A model's pipeline stages in this process alone (a one-process world must be up): P = 1, GPipe, CPU."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn

from dynmo_lightning.pipeline.stage.local import LocalStages
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.pipeline.topology.world import FixedWorld


def one_process_stages(model: nn.Module, n_microbatches: int = 4) -> LocalStages:
    """``model`` split into one stage on the CPU, run by GPipe over ``n_microbatches``."""
    return LocalStages.from_module(
        model,
        "uniform",
        FixedWorld(pipeline=PipelineGroup(0, None, [0])),
        stages_per_rank=1,
        schedule="gpipe",
        n_microbatches=n_microbatches,
        device=torch.device("cpu"),
        timeout=timedelta(seconds=30),
    )
