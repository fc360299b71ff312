"""One entry point for every partitioning method."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynmo_lightning.balance.diffusion.driver import diffuse
from dynmo_lightning.balance.partitioning.optimal import optimal_split
from dynmo_lightning.balance.split.checks import as_capacities, as_speeds, as_stage_count, as_values

METHODS = ("optimal", "uniform", "params", "static_time", "diffusion")


def _uniform(n_layers: int, n_stages: int) -> list[int]:
    size, extra = divmod(n_layers, n_stages)
    return [size + 1] * extra + [size] * (n_stages - extra)


def partition(
    costs: Sequence[float],
    n_stages: int,
    *,
    method: str = "optimal",
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """Split layers into contiguous pipeline stages.

    What each ``method`` does:

    * ``"optimal"``: the split minimising the bottleneck (largest stage cost), exactly. Why: whether a split within
      a bound ``B`` exists is monotone in ``B`` and decided exactly by a greedy (each stage takes the longest block
      within ``B``; no split covers more layers) or, with per-stage capacities, a dynamic programme; the optimum is
      a block sum; and a bisection whose ends snap onto block sums (a feasible probe's bottleneck above, the least
      block sum that could change a failing probe below) halves the gap with every probe and stops on the optimum
      itself, with no epsilon (details: :func:`~dynmo_lightning.balance.partitioning.optimal.optimal_split`). With
      ``memory`` and ``capacity``, only splits whose every stage fits its capacity count. Among optimal splits the
      lexicographically largest is returned: each stage, left to right, takes as many layers as it can while the rest
      still fits the optimum.
    * ``"uniform"``: by layer count only; sizes differ by at most one, larger stages first (10 layers on 4 stages:
      ``[3, 3, 2, 2]``). Costs count only through their length, and memory limits are not enforced.
    * ``"params"``: DeepSpeed-style balancing of parameter counts; pass per-layer parameter counts as ``costs``.
      It is the optimal split of those counts, which DeepSpeed's ``partition_balanced`` only approximates.
    * ``"static_time"``: torchgpipe's ``balance_by_time``; pass per-layer times profiled once at the start. It is
      the optimal split of those times; never re-planning afterwards is the caller's policy.
    * ``"diffusion"``: the neighbour-only protocol of :func:`~dynmo_lightning.balance.diffusion.driver.diffuse`, started
      from the uniform split; it ends on an optimal split. It needs one capacity shared by all stages.

    Args:
        costs: per-layer cost (time, parameter count, ...), in model order; finite and non-negative.
        n_stages: number of pipeline stages, between 1 and ``len(costs)``.
        method: one of :data:`METHODS`.
        memory: memory each layer needs; requires ``capacity``.
        capacity: memory a stage may hold: one number for all stages or one per stage; requires ``memory``.
        speeds: relative speed of the process running each stage (one per stage; a stage's time is its cost sum
            over its speed: 0.5 takes twice as long), for ``"optimal"``, ``"params"`` and ``"static_time"``, which
            then minimise the largest stage *time*; ``None``: every process alike. ``"uniform"`` ignores them and
            ``"diffusion"`` refuses them (its stages plan from costs alone).

    Returns:
        Layers per stage: ``n_stages`` integers, each at least 1, summing to ``len(costs)``; stage ``i`` holds the
        next contiguous block of layers.

    Raises:
        ValueError: for an unknown method, ``n_stages`` below 1 or above the number of layers, a negative or
            non-finite cost, a memory list of the wrong length, or only one of ``memory`` and ``capacity``.
        InfeasibleMemoryError: if no split respects the capacities (the message names the stage or layer).

    """
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; valid methods: {', '.join(METHODS)}")
    values = as_values(costs, "costs")
    count = as_stage_count(n_stages, values.size)
    limits = as_capacities(memory, capacity, values.size, count)
    rates = None if speeds is None else as_speeds(speeds, count)
    if method == "uniform":
        return _uniform(values.size, count)
    if method == "diffusion":
        if rates is not None and not np.all(rates == rates[0]):
            raise ValueError("method='diffusion' plans from costs alone: drop speeds, or use method='optimal'")
        return diffuse(values, _uniform(values.size, count), memory=memory, capacity=capacity).layers_per_stage
    return optimal_split(values, count, limits, rates)
