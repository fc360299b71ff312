"""Pipeline runtime: stages from a partition, schedules from ``torch.distributed.pipelining``, layer bookkeeping."""

from dynmo_lightning.pipeline.layers import LayerSlots, RemoteLayer, StageModule
from dynmo_lightning.pipeline.runtime import SCHEDULES, PipelineRuntime, StagePlan

__all__ = ["SCHEDULES", "LayerSlots", "PipelineRuntime", "RemoteLayer", "StageModule", "StagePlan"]
