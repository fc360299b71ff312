"""What a split is, shared by every part of the planner: the lowest sub-package of :mod:`dynmo_lightning.balance`.

* ``checks`` - argument checks of costs, capacities and stage counts, with messages naming the fix.
* ``loads`` - partitions as layers-per-stage lists: validation, stage loads, bottleneck, imbalance, owners, bytes moved.
* ``placement`` - which pipeline rank runs each stage, per schedule (looped or V).
* ``fit`` - memory capacities: which blocks fit each stage, and :class:`InfeasibleMemoryError` when no split fits.
* ``bound_search`` - the search over candidate bottlenecks that the optimal split and diffusion's exact mode share.

Imports nothing of the package: NumPy and the standard library only.
"""
