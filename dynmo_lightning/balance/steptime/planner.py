"""Plan for what runs: the split with the smallest makespan under the schedule, within memory caps.

The bottleneck-optimal split (:func:`~dynmo_lightning.balance.partition`, minimum largest stage cost) is the
makespan-optimal one only when the steady state dominates. It is not where the fill and drain weigh (few
micro-batches: a heavy first stage hides in the others' fill), nor with several stages per rank, where a rank runs
the sum of its stages and the interleaving decides the makespan. :func:`makespan_split` therefore searches:

1. start from the bottleneck-optimal split (the planner's proven optimum for the steady state);
2. local search: move one cut by one layer, or one stage by one layer (two neighbouring cuts together), keep the
   best move while the makespan drops (:func:`~dynmo_lightning.balance.steptime.makespan.makespan`);
3. with two stages per rank, climb again from the split that balances the ranks' sums instead of the stages
   (:func:`~dynmo_lightning.balance.steptime.rank_split.rank_split`): the least largest stage leaves a rank free to hold
   two of the largest, and one-layer moves do not lead out of that when several ranks sit at the top (issue 38:
   from the stage seed alone, splits up to 1.4 times slower at 16 ranks);
4. a branch and bound over the stages, within a budget, bounded by the best found;
5. every candidate is first bounded below (:func:`~dynmo_lightning.balance.steptime.makespan.lower_bound`, each rank's
   own work after the first input reaches it): a candidate whose bound is not below the best makespan found is never
   simulated, so a search costs a few event-engine runs.

It is exact on every random small case of the brute-force tests (``tests/balance/test_planner.py``: 1F1B, GPipe,
interleaved 1F1B and zero-bubble with two stages per rank, ZBV and DualPipeV, with and without memory caps); on
larger problems it is a local optimum of the makespan that is never worse than the bottleneck-optimal split.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dynmo_lightning.balance.partitioning.methods import partition
from dynmo_lightning.balance.split.fit import InfeasibleMemoryError
from dynmo_lightning.balance.split.loads import validate_partition
from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import ZERO_BUBBLE, execute, lower_bound, rank_orders
from dynmo_lightning.balance.steptime.memory_model import MemoryCheck
from dynmo_lightning.balance.steptime.rank_split import rank_split

#: Partial splits the branch and bound visits before it settles for the local optimum.
NODE_BUDGET = 10_000
#: Event-engine runs the branch and bound may spend on complete splits before the incumbent stands.
SIM_BUDGET = 64
#: Relative improvement a split must be able to bring to be simulated (bounds within it are pruned): the search is
#: exact to this tolerance, far below what profiling resolves, and it keeps near-ties from being enumerated.
TOLERANCE = 1e-3


class StepModel:
    """Makespans of splits of one model's layers under one schedule: the planner's and the policy's step time.

    Args:
        fwd: forward time of each layer for one micro-batch.
        bwd: full backward time of each layer (input and weight gradients).
        n_microbatches: micro-batches per step.
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES`.
        p2p: time of one hop between ranks.
        wgt: weight-gradient part of each layer's backward (zero-bubble ``W`` tasks); ``None``: 0.
        stages_per_rank: stages each rank holds.
        speeds: relative speed of each rank (0.5: every task of its stages takes twice its measured-at-reference
            time), for splits over exactly that many ranks; ``None``: every rank alike. The costs are at the
            reference speed (1), as the policy's tracker normalises them
            (:class:`~dynmo_lightning.balance.decision.speeds.ProcessSpeeds`).
    """

    def __init__(
        self,
        fwd: Sequence[float],
        bwd: Sequence[float],
        n_microbatches: int,
        schedule: str = "1f1b",
        p2p: float = 0.0,
        *,
        wgt: Sequence[float] | None = None,
        stages_per_rank: int = 1,
        speeds: Sequence[float] | None = None,
    ) -> None:
        if len(fwd) != len(bwd) or (wgt is not None and len(wgt) != len(fwd)):
            raise ValueError(f"{len(fwd)} forward and {len(bwd)} backward times: give one of each per layer")
        self.speeds = _checked_speeds(speeds)
        self.n_layers = len(fwd)
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.p2p = float(p2p)
        self.stages_per_rank = stages_per_rank
        self._prefix = [np.concatenate([[0.0], np.cumsum(np.asarray(v, dtype=np.float64))]) for v in (fwd, bwd)]
        weights = np.zeros(self.n_layers) if wgt is None or schedule not in ZERO_BUBBLE else np.asarray(wgt, float)
        self._prefix.append(np.concatenate([[0.0], np.cumsum(weights)]))
        self.costs = [f + b for f, b in zip(fwd, bwd, strict=True)]
        self._memo: dict[tuple[int, ...], float] = {}
        #: Plans of :func:`makespan_split` on these costs, by its arguments.
        self.plans: dict[tuple[Any, ...], tuple[float, list[int]] | None] = {}

    def with_speeds(self, speeds: Sequence[float] | None) -> StepModel:
        """The same costs and schedule on ranks of ``speeds`` (a pipeline of other processes, e.g. after a repack)."""
        other = copy.copy(self)
        other.speeds = _checked_speeds(speeds)
        other._memo, other.plans = {}, {}
        return other

    def for_ranks(self, n_ranks: int) -> StepModel:
        """This model for a pipeline of ``n_ranks`` ranks.

        The first ranks keep their speeds; added ranks are unmeasured (the reference speed, 1).
        """
        if self.speeds is None or len(self.speeds) == n_ranks:
            return self
        return self.with_speeds((self.speeds + [1.0] * n_ranks)[:n_ranks])

    def stage_speeds(self, n_stages: int) -> list[float] | None:
        """The speed of the rank running each of ``n_stages`` stages (``None``: all alike)."""
        if self.speeds is None:
            return None
        n_ranks = n_stages // self.stages_per_rank
        if n_ranks != len(self.speeds) or n_stages % self.stages_per_rank:
            raise ValueError(
                f"a split of {n_stages} stages runs on {n_ranks} ranks, the model has speeds of {len(self.speeds)}: "
                "give one speed per rank of the pipeline planned (StepModel.with_speeds)"
            )
        ranks = stage_ranks(self.schedule, n_ranks, self.stages_per_rank)
        return [self.speeds[r] for r in ranks]

    def stage_times(self, split: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
        """Per-stage forward, backward and weight-part times of ``split`` (sums over the stage's rank's speed)."""
        bounds = np.concatenate([[0], np.cumsum(split)]).astype(int)
        sums = [np.diff(p[bounds]) for p in self._prefix]
        rates = self.stage_speeds(len(split))
        if rates is not None:
            sums = [v / np.asarray(rates) for v in sums]
        return tuple(v.tolist() for v in sums)  # type: ignore[return-value]

    def __call__(self, split: Sequence[int]) -> float:
        """The makespan of ``split`` (memoised: the planner and the policy ask for the same splits again)."""
        key = tuple(split)
        if key not in self._memo:
            self._memo[key] = self._simulate(key)
        return self._memo[key]

    def bound(self, split: Sequence[int]) -> float:
        """A lower bound of :meth:`__call__` that needs no simulation."""
        f, b, w = self.stage_times(split)
        n_ranks = len(split) // self.stages_per_rank
        ranks = stage_ranks(self.schedule, n_ranks, self.stages_per_rank)
        return lower_bound(f, b, self.n_microbatches, ranks, [x - y for x, y in zip(b, w, strict=True)])

    def _simulate(self, split: tuple[int, ...]) -> float:
        f, b, w = self.stage_times(split)
        if len(split) % self.stages_per_rank:
            raise ValueError(f"{len(split)} stages do not fill {self.stages_per_rank} stages on every rank")
        n_ranks = len(split) // self.stages_per_rank
        m = self.n_microbatches
        as_columns = (np.repeat(np.asarray(v, dtype=np.float64)[:, None], m, axis=1) for v in (f, b, w))
        return execute(
            _orders(self.schedule, n_ranks, m, self.stages_per_rank),
            stage_ranks(self.schedule, n_ranks, self.stages_per_rank),
            *as_columns,
            self.p2p,
        )[0]


def _checked_speeds(speeds: Sequence[float] | None) -> list[float] | None:
    """Per-rank speeds as floats (``None`` when absent or all alike: a common speed changes no choice)."""
    if speeds is None:
        return None
    rates = [float(v) for v in speeds]
    if not all(math.isfinite(v) and v > 0 for v in rates):
        raise ValueError(f"speeds={rates}: every rank's speed must be finite and > 0 (1: the reference)")
    return None if len(set(rates)) <= 1 and rates and rates[0] == 1.0 else rates


@functools.lru_cache(maxsize=256)
def _orders(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> tuple[tuple, ...]:
    return tuple(tuple(o) for o in rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank))


def makespan_split(
    model: StepModel,
    n_stages: int,
    *,
    memory: Sequence[float] | MemoryCheck | None = None,
    capacity: float | Sequence[float] | None = None,
    start: Sequence[int] | None = None,
) -> tuple[float, list[int]] | None:
    """The split of ``model``'s layers over ``n_stages`` with the smallest makespan found (see the module docstring).

    Args:
        model: the step model (costs, schedule, placement).
        n_stages: stages of the split (``stages_per_rank`` times the ranks).
        memory: what fits: memory each layer needs (with ``capacity``: every stage's sum within it), or a
            :class:`~dynmo_lightning.balance.steptime.memory_model.MemoryCheck` (every rank's predicted peak within its
            capacity, ``capacity`` unused).
        capacity: memory a stage may hold, one number or one per stage (with per-layer ``memory``).
        start: the split to climb from; default the bottleneck-optimal one.

    Returns:
        ``(makespan, split)``, or ``None`` when no split fits in memory.
    """
    fit = _Fit(memory, capacity, n_stages)
    key = (n_stages, fit.key, None if start is None else tuple(start))
    if key not in model.plans:  # the policy asks again at every check while the costs stand
        model.plans[key] = _search(model, n_stages, fit, start)
    found = model.plans[key]
    return None if found is None else (found[0], list(found[1]))


class _Fit:
    """What fits in memory, for the search: whole splits, and stages while a split is built (prune when false).

    From per-layer memory and capacities (a stage's sum), or from a
    :class:`~dynmo_lightning.balance.steptime.memory_model.MemoryCheck` (every rank's predicted peak).
    """

    def __init__(
        self, memory: Sequence[float] | MemoryCheck | None, capacity: float | Sequence[float] | None, n_stages: int
    ) -> None:
        self.check = memory if isinstance(memory, MemoryCheck) else None
        self.n_stages = n_stages
        self.memory = None if memory is None or self.check is not None else list(memory)
        self.capacity = capacity
        self.caps = _caps(capacity, n_stages) if self.memory is not None else None
        self.prefix = None if self.memory is None else np.concatenate([[0.0], np.cumsum(self.memory)])

    @property
    def key(self) -> Any:
        """What the search's result depends on."""
        if self.check is not None:
            return id(self.check)
        capacity = self.capacity
        return (None if self.memory is None else tuple(self.memory),
                capacity if capacity is None or isinstance(capacity, (int, float)) else tuple(capacity))  # fmt: skip

    @property
    def limited(self) -> bool:
        """Whether memory limits the splits at all."""
        return self.check is not None or self.prefix is not None

    def split(self, split: Sequence[int]) -> bool:
        """Whether a whole split fits."""
        if self.check is not None:
            return self.check.fits(split)
        return _fits(split, self.prefix, self.caps)

    def stage(self, stage: int, start: int, end: int) -> bool:
        """Whether stage ``stage`` may hold layers ``start..end`` (false: it cannot, nor with more layers)."""
        if self.check is not None:
            return self.check.stage_fits(self.n_stages, stage, start, end)
        if self.prefix is None or self.caps is None:
            return True
        return self.prefix[end] - self.prefix[start] <= self.caps[stage]

    def seed(self, costs: Sequence[float], speeds: Sequence[float] | None = None) -> list[int] | None:
        """The bottleneck-optimal split that fits, each stage's time its cost over ``speeds`` (``None``: none fits)."""
        try:
            if self.check is None:
                return list(partition(costs, self.n_stages, method="optimal", memory=self.memory,
                                      capacity=self.capacity, speeds=speeds))  # fmt: skip
        except InfeasibleMemoryError:
            return None
        seed = list(partition(costs, self.n_stages, method="optimal", speeds=speeds))
        return seed if self.check is None or self.check.fits(seed) else self.check.feasible(self.n_stages)


def _search(model: StepModel, n_stages: int, fit: _Fit, start: Sequence[int] | None) -> tuple[float, list[int]] | None:
    seed = fit.seed(model.costs, model.stage_speeds(n_stages))
    if seed is None:
        if fit.check is None:
            return None  # the bottleneck partitioner proved that no split fits
        # no split found to start from (several stages per rank): the exhaustive search alone, from nothing
        found = _branch_and_bound(model, n_stages, math.inf, [], fit)
        return found if found[1] else None
    best_split = list(seed)
    best = model(best_split)
    if start is not None:
        start = validate_partition(start, model.n_layers)
        if len(start) == n_stages and fit.split(start) and model(start) < best:
            best_split, best = list(start), model(start)
    best, best_split = _climb(model, best, best_split, fit)
    ranked = _rank_seed(model, n_stages)
    if ranked is not None and fit.split(ranked):
        # Climbed on its own: from either seed (or a warm start: the split planned for the step before, as the
        # oracle plans every step) the climb can stop on a local optimum the other one passes. Left out once, a
        # warm-started oracle stayed on a split the policy, planning from both seeds, beat by 1 % (issue 38).
        found = _climb(model, model(ranked), ranked, fit)
        if found[0] < best:
            best, best_split = found
    return _branch_and_bound(model, n_stages, best, best_split, fit)


def _rank_seed(model: StepModel, n_stages: int) -> list[int] | None:
    """With two stages per rank, the split that balances the ranks' sums (:func:`rank_split`), else ``None``.

    The bottleneck-optimal seed balances stages; a rank running two of them can hold two of the largest, and one-layer
    moves do not climb out of that (every rank near the top must drop at once for the makespan to drop).
    """
    if model.stages_per_rank != 2 or model.speeds is not None:
        return None  # with speeds that differ the climb from the speed-aware bottleneck seed and the search remain
    fwd = np.diff(model._prefix[0]).tolist()
    return rank_split(fwd, model.costs, n_stages // 2, model.n_microbatches, model.schedule)


def _climb(model: StepModel, best: float, best_split: list[int], fit: _Fit) -> tuple[float, list[int]]:
    """Best-improvement local search over :func:`_neighbours` (bounded candidates are never simulated)."""
    while True:
        improved = None
        for candidate in _neighbours(best_split):
            if model.bound(candidate) >= best * (1 - TOLERANCE) or not fit.split(candidate):
                continue
            t = model(candidate)
            if t < best * (1 - TOLERANCE) and (improved is None or t < improved[0]):
                improved = (t, candidate)
        if improved is None:
            return best, best_split
        best, best_split = improved


def _branch_and_bound(
    model: StepModel, n_stages: int, best: float, best_split: list[int], fit: _Fit
) -> tuple[float, list[int]]:
    """Every split whose lower bound beats the incumbent, stage by stage, within :data:`NODE_BUDGET` nodes.

    A partial split (stages ``0..k`` fixed) is cut off when a rank's bound already reaches the incumbent: the
    forwards before its first stage plus ``M`` times the work of its stages fixed so far, or, for the ranks of the
    stages still open, ``M`` times their fixed work plus the layers left, shared as evenly as possible; or when a
    stage no longer fits in memory. Exhaustive (hence exact) when it ends within the budget; otherwise the
    incumbent stands.
    """
    n_layers, m = model.n_layers, model.n_microbatches
    ranks = stage_ranks(model.schedule, n_stages // model.stages_per_rank, model.stages_per_rank)
    n_ranks = max(ranks) + 1
    pf, pb, pw = (p.tolist() for p in model._prefix)
    cost = [f + b for f, b in zip(pf, pb, strict=True)]
    first = [ranks.index(r) for r in range(n_ranks)]
    # With speeds a rank's work takes its cost over its speed; what runs on other ranks before its first stage is
    # bounded by the fastest speed, and the open ranks share the rest in proportion to their speeds.
    speed = model.speeds or [1.0] * n_ranks
    fastest = max(speed)
    # With one stage per rank the last backward of a stage still crosses the stages before it (lower_bound's tail).
    single = n_ranks == n_stages
    open_ranks = [sorted(set(ranks[k + 1 :])) for k in range(n_stages)]
    open_speed = [sum(speed[q] for q in open_r) for open_r in open_ranks]
    nodes, sims = 0, len(model._memo) + SIM_BUDGET
    split: list[int] = []
    load = [0.0] * n_ranks
    incumbent = [best, list(best_split)]

    def _candidate_ends(stage: int, start: int, r: int, bar: float) -> list[int]:
        """Ends to try for stage ``stage`` from layer ``start`` on rank ``r``: those that fit, bounds below ``bar``."""
        left = n_stages - stage - 1
        ends: list[int] = []
        for end in range(start + 1 if left else n_layers, n_layers - left + 1):
            if fit.limited and not fit.stage(stage, start, end):
                break
            add = cost[end] - cost[start]
            own = pf[first[r]] / fastest + m * (load[r] + add) / speed[r]
            if single and pw[end] == pw[start]:
                own += (pb[start] - pw[start]) / fastest
            if own >= bar:
                break  # a longer stage only adds to this rank
            if left:
                fixed = sum(load[q] for q in open_ranks[stage]) + (add if r in open_ranks[stage] else 0.0)
                if m * (fixed + cost[n_layers] - cost[end]) / open_speed[stage] >= bar:
                    continue
            ends.append(end)
        return ends

    def visit(stage: int, start: int) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > NODE_BUDGET or len(model._memo) > sims:
            return
        if stage == n_stages:
            t = model(split)
            if t < incumbent[0] * (1 - TOLERANCE) and fit.split(split):
                incumbent[0], incumbent[1] = t, list(split)
            return
        r = ranks[stage]
        ends = _candidate_ends(stage, start, r, incumbent[0] * (1 - TOLERANCE))
        # Nearest the incumbent's cut first: good splits are found early and bound the rest harder.
        target = sum(incumbent[1][: stage + 1]) if incumbent[1] else (stage + 1) * n_layers // n_stages
        for end in sorted(ends, key=lambda e: abs(e - target)):
            add = cost[end] - cost[start]
            load[r] += add
            split.append(end - start)
            visit(stage + 1, end)
            split.pop()
            load[r] -= add

    visit(0, 0)
    return incumbent[0], incumbent[1]


def _neighbours(split: list[int]) -> list[list[int]]:
    """Splits one layer away: one cut moved (a layer crosses between neighbours), or one stage shifted."""
    out = []
    n = len(split)
    for k in range(n - 1):  # cut between stage k and k + 1
        for d in (1, -1):
            s = list(split)
            s[k] += d
            s[k + 1] -= d
            if s[k] >= 1 and s[k + 1] >= 1:
                out.append(s)
    for k in range(1, n - 1):  # stage k keeps its size and moves by one layer: both its cuts move together
        for d in (1, -1):
            s = list(split)
            s[k - 1] += d
            s[k + 1] -= d
            if s[k - 1] >= 1 and s[k + 1] >= 1:
                out.append(s)
    return out


def _caps(capacity: float | Sequence[float] | None, n_stages: int) -> list[float] | None:
    if capacity is None:
        return None
    if isinstance(capacity, (int, float)):
        return [float(capacity)] * n_stages
    return [float(c) for c in capacity]


def _fits(split: Sequence[int], mem: np.ndarray | None, caps: list[float] | None) -> bool:
    if mem is None or caps is None:
        return True
    bounds = np.concatenate([[0], np.cumsum(split)]).astype(int)
    return all(float(u) <= c for u, c in zip(np.diff(mem[bounds]), caps, strict=True))


def even_memory(
    model: StepModel, check: MemoryCheck, split: Sequence[int], makespan: float, cost: float = 0.03
) -> list[int]:
    """The split whose ranks' predicted peaks are the most even found within ``cost`` of ``makespan``.

    From ``split`` (the fastest found) and from the split that fills the ranks most evenly
    (:meth:`~dynmo_lightning.balance.steptime.memory_model.MemoryCheck.feasible`), a local search over one-layer moves
    lowers the ratio of the largest to the smallest peak while the makespan stays within ``(1 + cost) * makespan`` and
    every rank fits. A heuristic: the even split it returns is not proven the most even.
    """
    bar = makespan * (1 + cost)
    best, spread = list(split), check.spread(split)
    even = check.feasible(len(split))
    if even is not None and model(even) <= bar and check.spread(even) < spread:
        best, spread = even, check.spread(even)
    while True:
        improved = None
        for candidate in _neighbours(best):
            if model.bound(candidate) > bar or not check.fits(candidate):
                continue
            s = check.spread(candidate)
            if s < spread * (1 - TOLERANCE) and (improved is None or s < improved[0]) and model(candidate) <= bar:
                improved = (s, candidate)
        if improved is None:
            return best
        spread, best = improved
