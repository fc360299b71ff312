"""Exact bottleneck-optimal contiguous partitioning, with optional per-stage memory capacities.

Arithmetic model: a block ``[s, e)`` of layers costs ``prefix[e] - prefix[s]`` in float64, with ``prefix`` the
running sum of the costs. That block cost only grows when the block grows, which is all the arguments below need,
so every statement here is exact in this arithmetic (and exact outright for integer-valued costs below 2**53).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dynmo_lightning.balance.split.bound_search import BoundSearch
from dynmo_lightning.balance.split.fit import MemoryRoom, block_tails, greedy_walk, reach
from dynmo_lightning.balance.split.loads import prefix_sums


class _Plan:
    """One partitioning problem: prefix sums, memory reaches and the two feasibility probes.

    With ``speeds`` (one per stage) a block ``[s, e)`` on stage ``k`` takes ``(prefix[e] - prefix[s]) / speeds[k]``:
    still monotone in the block, so every argument below holds with that stage time in place of the block sum.
    """

    def __init__(self, costs: np.ndarray, room: MemoryRoom, speeds: np.ndarray | None = None) -> None:
        self.n = costs.size
        self.prefix = prefix_sums(costs)
        self._prefix = self.prefix.tolist()
        self.room = room
        self.speeds = speeds
        self._last_split: tuple[float, list[int] | None] | None = None

    def _reaches(self, bound: float) -> list[np.ndarray]:
        """Per stage, the furthest end within the bound and its memory capacity from each start."""
        assert self.speeds is not None
        by_speed = {v: reach(self.prefix, bound, v) for v in set(self.speeds.tolist())}
        return [np.minimum(by_speed[v], room) for v, room in zip(self.speeds.tolist(), self.room.ends, strict=True)]

    def probe_relaxed(self, bound: float) -> tuple[bool, float]:
        """Greedy feasibility of splits that may leave stages empty.

        Each stage takes the longest block within the bound and its capacity. For a fixed bound this covers the
        most layers any split can: by induction, if some split's first ``p`` stages end at ``f``, the greedy's end
        at ``p`` is at least ``f``, because the block from the greedy's previous end to ``f`` lies inside that
        split's ``p``-th block, and block cost and memory only shrink when a block shrinks.

        Args:
            bound: the bottleneck bound to test.

        Returns:
            ``(True, bottleneck of the greedy split)`` or ``(False, least block sum above the bound that would let
            a stage stopped by the bound take one more layer)``; below that value the greedy runs identically, so
            no smaller bound is feasible either.

        """
        cost_reach = reach(self.prefix, bound).tolist()
        prefix, n = self._prefix, self.n
        start, worst, least_next = 0, 0.0, math.inf
        for room in self.room.lists:
            if start == n:
                break
            stop, fit = cost_reach[start], room[start]
            if stop < fit:
                least_next = min(least_next, prefix[stop + 1] - prefix[start])
            end = min(stop, fit)
            worst = max(worst, prefix[end] - prefix[start])
            start = end
        return (True, worst) if start == n else (False, least_next)

    def split(self, bound: float) -> list[int] | None:
        """Lexicographically largest split within a bound, with at least one layer per stage.

        Args:
            bound: the bottleneck bound.

        Returns:
            Layers per stage, each stage as long as possible from the left given that the later stages can still
            be filled; ``None`` if no split fits the bound.

        """
        # The final split is usually asked for at the bound the last probe just tested.
        if self._last_split is None or self._last_split[0] != bound:
            if self.speeds is None:
                tails = block_tails(reach(self.prefix, bound), self.room.ends)
            else:
                tails = block_tails(np.full(self.n + 1, self.n), self._reaches(bound))
            self._last_split = (bound, greedy_walk(tails))
        return self._last_split[1]

    def probe(self, bound: float) -> tuple[bool, float]:
        """Exact feasibility with at least one layer per stage (needed once capacities differ per stage).

        Args:
            bound: the bottleneck bound to test.

        Returns:
            ``(True, bottleneck of the split found)`` or ``(False, least block sum above the bound)``; the set of
            blocks within the bound, hence the answer, is the same for every bound below that value.

        """
        sizes = self.split(bound)
        if sizes is not None:
            ends = np.cumsum(sizes)
            times = self.prefix[ends] - self.prefix[ends - sizes]
            return True, float(np.max(times if self.speeds is None else times / self.speeds))
        if self.speeds is not None:
            return False, self._least_above(bound)
        cost_reach = reach(self.prefix, bound)
        open_starts = np.flatnonzero(cost_reach < self.n)
        if open_starts.size == 0:
            return False, math.inf
        return False, float(np.min(self.prefix[cost_reach[open_starts] + 1] - self.prefix[open_starts]))

    def _least_above(self, bound: float) -> float:
        """With speeds: the least stage time above ``bound`` of a block one layer longer than a stage may take."""
        assert self.speeds is not None
        least = math.inf
        for v in set(self.speeds.tolist()):
            cost_reach = reach(self.prefix, bound, v)
            open_starts = np.flatnonzero(cost_reach < self.n)
            if open_starts.size:
                longer = self.prefix[cost_reach[open_starts] + 1] - self.prefix[open_starts]
                least = min(least, float(np.min(longer / v)))
        return least


def _least_bound(search: BoundSearch, probe: Callable[[float], tuple[bool, float]]) -> float:
    while not search.done:
        search.record(*probe(search.point()))
    return search.hi


def optimal_split(
    costs: np.ndarray,
    n_stages: int,
    limits: tuple[np.ndarray, np.ndarray] | None,
    speeds: np.ndarray | None = None,
) -> list[int]:
    """Contiguous split minimising the largest stage cost, exactly; see :func:`~dynmo_lightning.balance.partition`.

    Why it is optimal: feasibility of a bound is monotone in the bound, and the optimum is one of the block sums.
    :class:`BoundSearch` keeps a feasible block sum above and an infeasible-proven value below, and each probe
    moves one of them onto a block sum (the split's bottleneck, or the least block sum that could change the
    probe's answer) while halving the gap, so it ends on the optimum itself. Probes first use the greedy of
    :meth:`_Plan.probe_relaxed`, optimal for splits that may leave stages empty; with no capacities or one shared
    capacity that loses nothing, since moving single layers into empty stages from the end never raises the
    bottleneck or breaks the capacity. With per-stage capacities, the exact dynamic programme of :meth:`_Plan.split`
    continues the search from there. Among optimal splits the lexicographically largest one is returned: each stage,
    left to right, takes as many layers as it can while the rest can still be split within the optimum.

    Args:
        costs: checked per-layer costs.
        n_stages: checked number of stages (at most the number of layers).
        limits: ``(per-layer memory, per-stage capacity)`` or ``None``.
        speeds: the relative speed of the process running each stage (a stage's time is its cost sum over its
            speed), or ``None``: all alike. With speeds that differ, the greedy of empty stages proves nothing (a
            layer moved into an empty slow stage can exceed the bound), so the exact programme searches alone,
            from the bound every split must reach (the total over the summed speeds).

    Returns:
        Layers per stage.

    Raises:
        InfeasibleMemoryError: if no split respects the capacities.

    """
    room = MemoryRoom(limits, costs.size, n_stages)
    room.require_fit()
    if speeds is not None and np.all(speeds == speeds[0]):
        speeds = None  # a common speed scales every stage alike: the same splits are optimal
    plan = _Plan(costs, room, speeds)
    if speeds is not None:
        lower = float(plan.prefix[-1]) / float(np.sum(speeds))
        slowest = float(np.max(np.diff(plan.prefix))) / float(np.min(speeds))
        bound = _least_bound(BoundSearch(lower, (lower, lower + slowest)), plan.probe)
        sizes = plan.split(bound)
        assert sizes is not None, "the bound came from a feasible probe"
        return sizes
    single = float(np.max(np.diff(plan.prefix)))
    balanced = max(single, float(plan.prefix[-1]) / n_stages)
    # Without limits the optimum lies in [total / P, total / P + largest layer]: good first guesses.
    relaxed = _least_bound(BoundSearch(single, (balanced, balanced + single)), plan.probe_relaxed)
    bound = _least_bound(BoundSearch(relaxed, (relaxed,)), plan.probe)
    sizes = plan.split(bound)
    assert sizes is not None, "the bound came from a feasible probe"
    return sizes
