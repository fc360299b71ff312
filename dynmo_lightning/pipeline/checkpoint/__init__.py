"""Checkpoints of a split model (imports ``topology``, ``parallel`` and ``stage``; not ``elastic``).

* ``single_file`` - one file with the unsplit model's keys, optimizer state by name, an atomic ``CheckpointIO``.
* ``sharded`` - sharded checkpoints: each stage writes its layers (``torch.distributed.checkpoint``), any width reads.
* ``safe_load`` - reading checkpoint files without running code from them.
* ``resume`` - a restarted job (torchrun's elastic agent, Slurm requeue) finds the run's newest complete checkpoint.
"""
