"""The pipeline runtime, one room per job; ``DynMoStrategy`` orchestrates them.

* ``checkpoint`` - one file with the unsplit model's keys, optimizer state by name, an atomic ``CheckpointIO``.
* ``compiled`` - layers compiled in place (``strategy.compile``), eager again while they migrate.
* ``elastic`` - who is in the job and where (nodes, stable process ids), who waits, calling them back (grow).
* ``evaluation`` - what validation and test steps log: the loss, perplexity of token targets, the module's own.
* ``groups`` - restarting the world among survivors (each survivor's view of it) and releasing the others.
* ``launcher`` - starting the job's processes, after the checks that must fail before any worker starts.
* ``layers`` - which layers this process holds, where each sits in the user's module, placeholders for remote ones.
* ``layout`` - replicas, tensor-parallel groups, data shards and batch parts, THE rank mapping, the device mesh.
* ``migration`` - layers moving between processes with everything that defines them; packing onto fewer ranks.
* ``neighbours`` - diffusion balancing at runtime: one protocol stage per process, cards sent to its neighbours.
* ``plugins`` - the strategy's wrapping of the Trainer's plugins: clipping over all stages, atomic checkpoints.
* ``precision`` - the Trainer's precision plugin, with clipping by the pipeline's global gradient norm.
* ``reduce`` - whole-model sums over stages (loss, gradient and parameter norms, layer costs), averages over replicas.
* ``release`` - telling the job manager (Slurm, a command) which ranks and whole nodes a consolidation freed.
* ``reshape`` - a layer held in parts stripped whole, changed (structured pruning) and made parts again; every layer
  re-homed on a new world's meshes after a consolidation or growth.
* ``resize`` - the strategy's shrink and grow (it reads ``ResizeHost``, returns ``Resized``, never writes back).
* ``runtime`` - stages and schedules of ``torch.distributed.pipelining`` from a partition (:class:`StagePlan`).
* ``safe_load`` - reading checkpoint files without running code from them.
* ``sharded`` - sharded checkpoints: each stage writes its layers (``torch.distributed.checkpoint``), any width reads.
* ``sharding`` - data parallelism inside a stage: DDP, or FSDP2 / replicate units; sharded layers' migration.
* ``tensor_parallel`` - layers split over the processes of their stage: the model's plan or the built-in ones.
* ``split`` - the first partition; dropping other stages' layers; materialising this stage's from per-layer seeds.
* ``stages`` - :class:`~dynmo_lightning.pipeline.stages.LocalStages`: split model, ties and runtime of one process.
* ``strategy_settings`` - :class:`StrategySettings`: the strategy's settings, one name and one default each.
* ``ties`` - parameters shared by layers on different stages, kept exact on any partition.
* ``transport`` - host data over the CPU control group, tensors by batched point-to-point on the device.
* ``watchdog`` - heartbeats, and failure messages that name the lost rank and the phase.
* ``worlds`` - a fresh world per Trainer call in one process, every world ended in order at exit.

Imports run downwards only: ``layout`` and ``layers`` import no other room; ``stages`` is the only room that imports
``split``, ``ties``, ``migration`` and ``runtime`` together.
"""

from dynmo_lightning.pipeline.layers import LayerSlots, RemoteLayer, StageModule
from dynmo_lightning.pipeline.runtime import SCHEDULES, PipelineRuntime, StagePlan

__all__ = ["SCHEDULES", "LayerSlots", "PipelineRuntime", "RemoteLayer", "StageModule", "StagePlan"]
