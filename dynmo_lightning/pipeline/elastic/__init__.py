"""Worlds that change while training runs (imports ``topology``, ``parallel`` and ``stage``; not ``checkpoint``).

* ``survivors`` - restarting the world among survivors (each survivor's view of it) and releasing the others.
* ``members`` - who is in the job and where (nodes, stable process ids), who waits, calling them back (grow).
* ``release`` - telling the job manager (Slurm, a command) which ranks and whole nodes a consolidation freed.
* ``resize`` - the strategy's shrink and grow (``Resizer``: it changes the ``World`` in place, returns ``Resized``).
* ``lifetimes`` - a fresh world per Trainer call in one process, every world ended in order at exit.
* ``lost`` - recovery without restart: where the survivors of a loss meet and agree, who goes on, the step's commit.
* ``mirror`` - copies of FSDP2's shards on a replica peer, exchanged every step, so a lost shard has another holder.
"""
