"""The pipeline runtime, one room per job; ``DynMoStrategy`` orchestrates them.

* ``layout`` - replicas of the pipeline, their data shards and batch parts, THE pipeline-rank / global-rank mapping
  (:class:`~dynmo_lightning.pipeline.layout.PipelineGroup`), the process groups and ``("dp", "pp")`` device mesh,
  and THE device a group's tensors live on (:func:`~dynmo_lightning.pipeline.layout.group_device`).
* ``split`` - the first partition; dropping other stages' layers; materialising this stage's from per-layer seeds.
* ``layers`` - where each layer sits in the user's module, placeholders for remote layers.
* ``runtime`` - stages and schedules of ``torch.distributed.pipelining`` from a partition (:class:`StagePlan`).
* ``migration`` - layers moving between processes with everything that defines them; packing onto fewer ranks.
* ``transport`` - host data over the pipeline's CPU control group, tensors by batched point-to-point on its device
  (what migration and the shape probe send).
* ``ties`` - parameters shared by layers on different stages.
* ``stages`` - :class:`~dynmo_lightning.pipeline.stages.LocalStages`: the split model, ties and runtime of one
  process kept consistent through steps and moves.
* ``reduce`` - whole-model quantities over stages (loss, gradient norm, parameter norm, layer costs) and averages
  over replicas.
* ``precision`` - the Trainer's precision plugin, clipping by the global norm; ``checkpoint`` - one file with the
  unsplit model's keys, optimizer state by name, an atomic ``CheckpointIO``.
* ``groups`` - restarting the world among survivors and releasing the others; ``launcher`` - checks run before any
  worker starts; ``watchdog`` - heartbeats and named phases.

Imports run downwards only: ``layout`` and ``layers`` import no other room; ``stages`` is the only room that imports
``split``, ``ties``, ``migration`` and ``runtime`` together.
"""

from dynmo_lightning.pipeline.layers import LayerSlots, RemoteLayer, StageModule
from dynmo_lightning.pipeline.runtime import SCHEDULES, PipelineRuntime, StagePlan

__all__ = ["SCHEDULES", "LayerSlots", "PipelineRuntime", "RemoteLayer", "StageModule", "StagePlan"]
