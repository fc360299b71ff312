"""Choosing a split by one of the methods (imports ``split`` and ``diffusion``).

* ``methods`` - :func:`~dynmo_lightning.balance.partition` with its :data:`~dynmo_lightning.balance.METHODS`:
  ``optimal``, ``uniform``, ``params``, ``static_time`` and ``diffusion``.
* ``optimal`` - the exact bottleneck-optimal contiguous split, optionally under per-stage memory capacities.
"""
