"""The split that balances ranks, not stages, when every rank holds two stages (the V of ZBV/DualPipeV, or a loop).

With one stage per rank the bottleneck-optimal split (:func:`~dynmo_lightning.balance.partition`, least
largest stage) is the steady state's optimum. With two stages per rank it is not: a rank runs the sum of its two stages,
and the least largest *stage* leaves those sums to chance. In the 64-layer model of the scale benchmark on 16 ranks in a
V, whose vocabulary head alone outweighs any two blocks, every split whose stages stay under the head's cost has the
least bottleneck; the partitioner's tie-break fills the front stages up to it, and rank 0 holds the head beside a front
stage as heavy as the head (issue 38). :func:`rank_split` balances what the planner bounds a rank by instead
(:func:`~dynmo_lightning.balance.steptime.makespan.lower_bound`): the forwards before the rank's first stage plus ``M``
times the work of its two stages.

Balanced how: the least bound of the slowest rank has ties too (the rank holding the head sets it, whatever the
others hold), and ranks left at that bound beside it each add their own fill and drain to the step (the pruned model
above: four ranks at the bound make a step 13 % longer than one). So the bounds are filled level by level, as water
fills a vessel: the least bound ``B`` every rank not yet fixed can keep to (a bisection), then the ranks that cannot go
below it are fixed at it (group tests: lower a group together; if that fails, halve it), and the next level goes on
with the others, until every rank is fixed.

Rank ``r`` holds stage ``r`` and, in a loop (interleaved schedules), stage ``R + r``; in a V, stage ``2R - 1 - r``.
Both read the layers as two sequences that rank ``r`` takes its ``r``-th block of each from: the first from layer 0
up; the second from the turn ``q`` (the start of stage ``R``) up in a loop, from the last layer down in a V, where
rank ``R - 1`` takes the middle that is left, its two stages one contiguous block. For per-rank bounds a dynamic
programme over the ranks keeps, for every cut ``a`` of the first sequence (and every turn ``q`` of a loop), the
furthest cut of the second one reached with every rank so far within its bound. Keeping the furthest cut is what
makes the result a seed and not a proof: it is exact unless a shorter rest of the second sequence is harder to share
out (the one-layer-per-stage rule can force a stage onto a costlier layer). The planner climbs from it and searches
on either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dynmo_lightning.balance.split.placement import V_SCHEDULES

#: Relative width of the bound bracket at which the bisection stops (the planner's search refines the rest).
RELATIVE_GAP = 1e-3


def rank_split(
    fwd: Sequence[float],
    costs: Sequence[float],
    n_ranks: int,
    n_microbatches: int,
    schedule: str,
) -> list[int] | None:
    """The split of two stages per rank whose ranks' bounds are (about) the least, level by level.

    Args:
        fwd: forward time of each layer (the fill before a rank's first stage).
        costs: forward plus backward time of each layer.
        n_ranks: pipeline ranks ``R`` (``2 R`` stages).
        n_microbatches: micro-batches per step ``M``.
        schedule: the schedule, which places the stages (a V for :data:`~dynmo_lightning.balance.split.placement.
            V_SCHEDULES`, a loop otherwise).

    Returns:
        ``2 R`` stage sizes in stage order, or ``None`` when there are fewer than ``2 R`` layers.
    """
    if len(costs) < 2 * n_ranks:
        return None
    programme = _Programme(fwd, costs, n_ranks, n_microbatches, schedule in V_SCHEDULES)
    bounds = np.full(n_ranks, np.inf)
    fixed = np.zeros(n_ranks, dtype=bool)
    best = programme.cuts(bounds)
    assert best is not None  # without a bound the programme reaches a split
    while not fixed.all():  # each level fixes one rank at least
        free = ~fixed
        hi = float(programme.bounds(best)[free].max())
        # no free rank does less than the mean of the work the fixed ranks cannot hold
        lo = max(0.0, (n_microbatches * programme.c[-1] - bounds[fixed].sum()) / free.sum())
        while hi - lo > RELATIVE_GAP * hi:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # no float between them (subnormal times): the bisection cannot go on
                break
            found = programme.cuts(np.where(free, mid, bounds))
            if found is None:
                lo = mid
            else:
                best, hi = found, float(programme.bounds(found)[free].max())
        level = np.where(free, hi, bounds)
        if not fixed.any():  # a loop's later levels keep the turn of the slowest rank's least bound (one turn
            programme.settle(best[0])  # is a fiftieth of the work: the levels after it order ranks already within)
        reached = programme.bounds(best)
        candidates = [r for r in np.flatnonzero(free) if reached[r] >= hi * (1 - RELATIVE_GAP)]
        forced = _forced(programme, level, candidates, hi * (1 - 2 * RELATIVE_GAP)) or candidates
        fixed[forced] = True
        bounds[forced] = hi
    return programme.sizes(best)


def _forced(programme: _Programme, level: np.ndarray, group: list[int], lowered: float) -> list[int]:
    """The ranks of ``group`` that cannot go below ``lowered`` while the others stay within ``level``.

    Group testing: a group that can be lowered all together holds no such rank; one that cannot is halved.
    """
    if not group or programme.cuts(np.where(np.isin(np.arange(level.size), group), lowered, level)) is not None:
        return []
    if len(group) == 1:
        return group
    half = len(group) // 2
    return _forced(programme, level, group[:half], lowered) + _forced(programme, level, group[half:], lowered)


#: A split as the programme sees it: the turn, the first sequence's cuts and the layers taken from the second one
#: before each rank.
_Cuts = tuple[int, list[int], list[int]]


class _Programme:
    """The dynamic programme of the module docstring over one model's costs and one placement."""

    def __init__(self, fwd: Sequence[float], costs: Sequence[float], n_ranks: int, m: int, v: bool) -> None:
        self.pf = np.concatenate([[0.0], np.cumsum(np.asarray(fwd, dtype=np.float64))])
        self.c = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
        self.n, self.n_ranks, self.m, self.v = len(costs), n_ranks, m, v
        # A V needs no turn until the end (the last rank's middle holds it): one row. A loop has one per turn that
        # leaves every rank a layer of each sequence.
        self.turns = np.array([0]) if v else np.arange(n_ranks, self.n - n_ranks + 1)
        self.a = np.arange(self.n + 1)

    def cuts(self, bounds: np.ndarray) -> _Cuts | None:
        """A split with every rank ``r``'s bound within ``bounds[r]`` (``None``: the programme finds none)."""
        n = self.n
        parents, budgets, last = self._forward(bounds)
        within = np.isfinite(last) & (last <= bounds[-1])
        if not within.any():
            return None
        turn, end = np.unravel_index(np.where(within, last, np.inf).argmin(), last.shape)
        firsts = [int(end)]
        for parent in reversed(parents):
            firsts.append(int(parent[turn, firsts[-1]]))
        firsts.reverse()
        # The second sequence's cuts again, forward from the first's: the greedy reach the programme kept.
        seconds = [0]
        for r in range(self.n_ranks - 1):
            left = budgets[r][firsts[r], firsts[r + 1]]
            taken = int(self._extend(np.array([[[seconds[-1]]]]), np.array([[[left]]]), turn)[0, 0, 0])
            rest = self.n_ranks - 1 - r
            cap = n - 2 * rest - firsts[r + 1] if self.v else n - int(self.turns[turn]) - rest
            seconds.append(min(taken, cap))
        return int(self.turns[turn]), firsts, seconds

    def settle(self, turn: int) -> None:
        """Plan at one turn from now on (a loop's; a V has none until its end)."""
        if not self.v:
            self.turns = np.array([turn])

    def _forward(self, bounds: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """The programme over the ranks: each rank's parents and budgets, and the last rank's bound per state."""
        n, m, c, a = self.n, self.m, self.c, self.a
        reach = np.full((self.turns.size, n + 1), -1)  # [turn, first cut]: layers taken from the second, -1: none
        reach[:, 0] = 0
        parents, budgets = [], []
        first = c[None, :] - c[:, None]  # [a, a2]: the work of the first sequence's block
        for r in range(self.n_ranks - 1):
            rest = self.n_ranks - 1 - r  # later ranks, each needing a layer of both sequences
            budget = (bounds[r] - self.pf[:, None]) / m - first  # [a, a2]: left for the second sequence
            budgets.append(budget)
            taken = self._extend(np.maximum(reach, 0)[:, :, None], budget[None])
            ok = (a[None, :] > a[:, None])[None] & (budget >= 0)[None] & (reach >= 0)[:, :, None]
            if self.v:  # the middle left must give every later rank two layers
                taken = np.minimum(taken, n - 2 * rest - a[None, None, :])
            else:
                ok &= a[None, None, :] <= (self.turns - rest)[:, None, None]
                taken = np.minimum(taken, (n - self.turns - rest)[:, None, None])
            scored = np.where(ok & (taken > reach[:, :, None]), taken, -1)
            parents.append(scored.argmax(axis=1))  # [turn, a2]: the cut before it
            reach = scored.max(axis=1)
        return parents, budgets, self._last(reach)

    def _extend(self, taken: np.ndarray, budget: np.ndarray, turn: int | None = None) -> np.ndarray:
        """Layers of the second sequence taken after ``taken`` of them when ``budget`` more work fits."""
        c, n = self.c, self.n
        if self.v:  # from the last layer down: layers [n - t2, n - t) cost c[n - t] - c[n - t2]
            return n - np.searchsorted(c, c[n - taken] - budget, side="left")
        q = (self.turns if turn is None else self.turns[turn : turn + 1])[:, None, None]
        return np.searchsorted(c, c[q + taken] + budget, side="right") - 1 - q

    def _last(self, reach: np.ndarray) -> np.ndarray:
        """``[turn, a]``: the last rank's bound when it takes both rests (``inf`` where it cannot)."""
        n, c, a = self.n, self.c, self.a
        taken = np.maximum(reach, 0)
        if self.v:  # the middle [a, n - taken), at least two layers
            work, ok = c[n - taken] - c[None, :], n - taken - a[None, :] >= 2
        else:
            q = self.turns[:, None]
            work = c[q] - c[None, :] + c[n] - c[q + taken]
            ok = (a[None, :] < q) & (taken < n - q)
        return np.where(ok & (reach >= 0), self.pf[None, :] + self.m * work, np.inf)

    def bounds(self, cuts: _Cuts) -> np.ndarray:
        """Every rank's bound under ``cuts``: the forwards before its first stage plus ``M`` times its work."""
        sizes = np.asarray(self.sizes(cuts))
        ends = np.cumsum(sizes)
        work = self.c[ends] - self.c[ends - sizes]
        r = np.arange(self.n_ranks)
        second = 2 * self.n_ranks - 1 - r if self.v else self.n_ranks + r
        return self.pf[ends[r] - sizes[r]] + self.m * (work[r] + work[second])

    def sizes(self, cuts: _Cuts) -> list[int]:
        """Stage sizes in stage order."""
        q, firsts, seconds = cuts
        n, ends = self.n, [*seconds[1:]]
        if self.v:  # the last rank's middle: its two stages split where their costs are closest to even
            lo, hi = firsts[-1], n - seconds[-1]
            half = 0.5 * (self.c[lo] + self.c[hi])
            q = int(np.clip(np.searchsorted(self.c, half), lo + 1, hi - 1))
        first = [b - a for a, b in zip(firsts, [*firsts[1:], q], strict=True)]
        second = [b - a for a, b in zip(seconds, [*ends, n - q], strict=True)]
        return first + (second[::-1] if self.v else second)
