"""Who is who and how they talk: the lowest part of the runtime (imports nothing else of ``pipeline/``).

* ``ranks`` - replicas, tensor-parallel groups, data shards and batch parts: THE rank mapping (``ReplicaLayout``).
* ``mesh`` - the process groups and the ``("dp", "pp", "tp")`` device mesh of one layout (``Mesh``, ``PipelineGroup``).
* ``world`` - ``World``: the layout, meshes and groups, cluster environment and heartbeats one process runs in now.
* ``data`` - sharding the user's dataloaders over the replicas, in the user's order; a lost replica's shard taken over.
* ``transport`` - host data over the CPU control group, tensors by batched point-to-point on the device.
* ``heartbeats`` - heartbeats, and failure messages that name the lost rank and the phase.
* ``pending`` - background work over the world's groups (checkpoint writes), waited for before the world ends.
* ``abandon`` - a broken world's pending calls made to fail at once (NCCL abort; gloo's connections shut down).
"""
