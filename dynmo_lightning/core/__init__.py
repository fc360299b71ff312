"""The lowest layer of the package, one idea per module; every other room may import it, it imports none of them.

* ``model`` - the pipeline model contract (``pipeline_layers``, ``pipeline_loss``) and :class:`PipelineModule`.
* ``layer_init`` - seeded initialisation: layer ``i`` gets the same weights on any stage and device.
* ``context`` - what the forward in progress is: a probe, host-only work, one stage forward.
* ``host_values`` - reading device values without stalling: scalar buffers the host knows, numbers read once.
* ``parts`` - tensors held in parts (FSDP2 shards, tensor-parallel splits).
* ``control`` - the strategy contracts callbacks rely on: ``PipelineControl``, ``PreLaunchCheck``, ``JobShape``.
* ``callback_tools`` - a callback's layers, telling the strategy they changed, agreeing with the other processes.
* ``layer_calls`` - calling layers: tuple outputs as arguments, frozen prefixes without autograd.
* ``composition`` - what composes with what: the one table of parallel modes, schedules and elastic settings a job
  refuses, each a row of docs/errors.md.

``dynmo_lightning.protocol`` re-exports all of it for users.
"""
