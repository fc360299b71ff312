"""The stages one process runs (imports ``topology`` and ``parallel``).

* ``cut`` - the first partition; dropping other stages' layers; materialising this stage's from per-layer seeds.
* ``slots`` - which layers this process holds, where each sits in the user's module, placeholders for remote ones.
* ``ties`` - parameters shared by layers on different stages, kept exact on any partition.
* ``runtime`` - stages and schedules of ``torch.distributed.pipelining`` from a partition (``StagePlan``).
* ``schedules`` - the schedules a pipeline may run (``SCHEDULES``) and what each needs of ranks and micro-batches.
* ``torch_stage`` - the ``PipelineStage`` the runtime gives torch's schedules (static metadata, missing gradients).
* ``local`` - ``LocalStages``: split model, ties and runtime of one process, kept consistent.
* ``migration`` - layers moving between processes with everything that defines them; packing onto fewer ranks.
* ``reshape`` - a layer held in parts stripped whole, changed (structured pruning) and made parts again; every layer
  re-homed on a new world's meshes after a consolidation or growth.
* ``reduce`` - whole-model sums over stages (loss, gradient and parameter norms, layer costs), averages over replicas.
* ``evaluation`` - what validation and test steps log: the loss, perplexity of token targets, the module's own.
* ``neighbours`` - diffusion balancing at runtime: one protocol stage per process, cards sent to its neighbours.
"""
