"""Memory capacities of a split: which blocks fit each stage, and the check that some split fits at all.

Shared by both partitioning methods: the optimal split (:mod:`~dynmo_lightning.balance.partitioning.optimal`) probes
with these reaches, and diffusion (:mod:`~dynmo_lightning.balance.diffusion`) checks the fit before its first round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dynmo_lightning.balance.split.checks import fmt
from dynmo_lightning.balance.split.loads import prefix_sums


class InfeasibleMemoryError(ValueError):
    """No contiguous split keeps every stage within its memory capacity with at least one layer per stage."""


def reach(prefix: np.ndarray, bound: float, speed: float = 1.0) -> np.ndarray:
    """Furthest end of a block starting at each layer whose sum (over ``speed``) stays within a bound.

    Args:
        prefix: running sums with a leading zero (see :func:`~dynmo_lightning.balance.split.loads.prefix_sums`).
        bound: largest allowed block time.
        speed: the speed of the process running the block: its time is its sum over the speed (1: the sum).

    Returns:
        Integer array ``r`` with ``r[s]`` the largest ``e >= s`` such that ``(prefix[e] - prefix[s]) / speed <=
        bound``, computed exactly in that float arithmetic (the planner's bottleneck is the same expression).

    """
    n = prefix.size - 1
    if bound == math.inf:
        return np.full(n + 1, n)
    # Find, per start, the largest float x with (x - prefix[s]) / speed <= bound (monotone in x); a rounded
    # prefix + bound * speed can be an ulp off. Dividing by 1.0 is exact, so without speeds this is the plain sum.
    limit = prefix + bound * speed
    while (above := (limit - prefix) / speed > bound).any():
        limit[above] = np.nextafter(limit[above], -np.inf)
    while (room := (np.nextafter(limit, np.inf) - prefix) / speed <= bound).any():
        limit[room] = np.nextafter(limit[room], np.inf)
    return np.searchsorted(prefix, limit, side="right") - 1


def block_tails(cost_reach: np.ndarray, rooms: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Backward pass over stages: how far each stage may reach and still leave a feasible split of the rest.

    Args:
        cost_reach: for each start layer, the furthest block end within the bound.
        rooms: per stage, for each start layer, the furthest block end within that stage's memory capacity.

    Returns:
        Per stage ``p``, an array whose entry ``s`` is the largest ``e`` with ``s < e <= min(cost_reach[s],
        rooms[p][s])`` from which stages ``p + 1, ...`` can cover the remaining layers, one or more layers each;
        an entry ``<= s`` means stage ``p`` cannot start at ``s``.

    """
    n = cost_reach.size - 1
    index = np.arange(n + 1)
    # latest[x]: largest valid start <= x for the stages after the current one (-1: none); after the last, only n.
    latest = np.where(index == n, n, -1)
    out: list[np.ndarray] = []
    for room in reversed(rooms):
        ends = latest[np.minimum(cost_reach, room)]
        out.append(ends)
        latest = np.maximum.accumulate(np.where(ends > index, index, -1))
    out.reverse()
    return out


def greedy_walk(tails: list[np.ndarray]) -> list[int] | None:
    """Forward pass: give each stage, left to right, the most layers that still leave a feasible rest.

    Args:
        tails: output of :func:`block_tails`.

    Returns:
        Layers per stage, or ``None`` if the first stage cannot start (no feasible split).

    """
    start, sizes = 0, []
    for ends in tails:
        end = int(ends[start])
        if end <= start:
            return None
        sizes.append(end - start)
        start = end
    return sizes


class MemoryRoom:
    """Per-stage memory limits as block reaches, and the check that some split respects them."""

    def __init__(self, limits: tuple[np.ndarray, np.ndarray] | None, n_layers: int, n_stages: int) -> None:
        self.limits = limits
        self.n_layers = n_layers
        if limits is None:
            unlimited = np.full(n_layers + 1, n_layers)
            self.ends = [unlimited] * n_stages
            self.lists = [unlimited.tolist()] * n_stages
            return
        memory, capacities = limits
        self.prefix = prefix_sums(memory)
        by_capacity = {cap: reach(self.prefix, cap) for cap in set(capacities.tolist())}
        lists = {cap: ends.tolist() for cap, ends in by_capacity.items()}
        self.ends = [by_capacity[cap] for cap in capacities.tolist()]
        self.lists = [lists[cap] for cap in capacities.tolist()]

    def require_fit(self) -> None:
        """Raise unless some split puts at least one layer on every stage within its capacity.

        Raises:
            InfeasibleMemoryError: naming the most concrete reason found, in this order: a single layer larger than
                every capacity; the stages filled greedily in turn (which places as many layers as any split can)
                running out before the last layer; a stage that cannot get a layer of its own.

        """
        if self.limits is None:
            return
        memory, capacities = self.limits
        n = self.n_layers
        biggest, largest = int(np.argmax(memory)), float(capacities.max())
        if memory[biggest] > largest:
            raise InfeasibleMemoryError(
                f"no contiguous split fits: a single layer {biggest} needs {fmt(memory[biggest])} > capacity "
                f"{fmt(largest)} of any stage; raise the capacity or split that layer"
            )
        placed = 0
        for room in self.lists:
            placed = room[placed]
        if placed < n:
            raise InfeasibleMemoryError(
                f"no contiguous split fits: filling stages 0..{len(self.lists) - 1} in turn with as many layers as "
                f"each capacity allows (which places the most any split can) covers layers 0..{placed - 1} only; "
                f"layers {placed}..{n - 1} still need {fmt(self.prefix[n] - self.prefix[placed])} (total memory "
                f"{fmt(self.prefix[n])} vs total capacity {fmt(capacities.sum())}); raise the capacity, add stages "
                "or cut per-layer memory"
            )
        tails = block_tails(np.full(n + 1, n), self.ends)
        if greedy_walk(tails) is None:
            raise InfeasibleMemoryError(self._explain_nonempty(tails))

    def _explain_nonempty(self, tails: list[np.ndarray]) -> str:
        """Name a stage that cannot get a layer of its own, given that the memory fits in total.

        Let ``q`` be the last stage such that stages ``q, q + 1, ...`` cannot split any tail of the model among
        themselves (tails starting at layer ``q`` or later; ``q = 0`` if there is no such stage). The stages after
        ``q`` can split the tails starting at some layers ``t``, but stage ``q`` can end at none of them: for
        ``q = 0``, layers ``0..t-1`` exceed its capacity; otherwise even the single layer ``t - 1`` does.

        Args:
            tails: :func:`block_tails` at an unlimited cost bound.

        Returns:
            The error message.

        """
        memory, capacities = self.limits
        n, n_stages = self.n_layers, len(tails)
        index = np.arange(n + 1)
        starts = [index[(ends > index) & (index >= stage)] for stage, ends in enumerate(tails)]
        q = max((stage for stage in range(1, n_stages) if starts[stage].size == 0), default=0)
        after = np.array([n]) if q == n_stages - 1 else starts[q + 1]
        lead = "no contiguous split gives every stage at least one layer within its capacity: "
        if q == 0:
            first = int(after[0])
            return lead + (
                f"stage 0 (capacity {fmt(capacities[0])}) would need {fmt(self.prefix[first])} for layers "
                f"0..{first - 1}, the fewest that leave a feasible split of the rest to stages 1..{n_stages - 1}"
            )
        layer = int(after[np.argmin(memory[after - 1])]) - 1
        where = "at the last layer" if q == n_stages - 1 else f"where stages {q + 1}..{n_stages - 1} can start"
        return lead + (
            f"stage {q} (capacity {fmt(capacities[q])}) can only end {where}, and the layer it would end with is "
            f"too large for it (the smallest such, layer {layer}, needs {fmt(memory[layer])})"
        )


def require_memory_fit(limits: tuple[np.ndarray, np.ndarray] | None, n_layers: int, n_stages: int) -> None:
    """Raise unless some contiguous split with one or more layers per stage respects every capacity.

    Args:
        limits: ``(per-layer memory, per-stage capacity)`` as checked arrays, or ``None`` for no limits.
        n_layers: layers in the model.
        n_stages: pipeline stages.

    Raises:
        InfeasibleMemoryError: with the most concrete reason found (see ``MemoryRoom.require_fit``).

    """
    MemoryRoom(limits, n_layers, n_stages).require_fit()
