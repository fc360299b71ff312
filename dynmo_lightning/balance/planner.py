"""Plan for what runs: the split with the smallest makespan under the schedule, within memory caps.

The bottleneck-optimal split (:func:`~dynmo_lightning.balance.partition`, minimum largest stage cost) is the
makespan-optimal one only when the steady state dominates. It is not where the fill and drain weigh (few
micro-batches: a heavy first stage hides in the others' fill), nor with several stages per rank, where a rank runs
the sum of its stages and the interleaving decides the makespan. :func:`makespan_split` therefore searches:

1. start from the bottleneck-optimal split (the planner's proven optimum for the steady state);
2. local search: move one cut by one layer, or one stage by one layer (two neighbouring cuts together), keep the
   best move while the makespan drops (:func:`~dynmo_lightning.balance.makespan.makespan`);
3. every candidate is first bounded below (:func:`~dynmo_lightning.balance.makespan.lower_bound`, each rank's own
   work after the first input reaches it): a candidate whose bound is not below the best makespan found is never
   simulated, so a search costs a few event-engine runs.

It is exact on every random small case of the brute-force tests (``tests/balance/test_planner.py``: 1F1B, GPipe,
interleaved with two stages per rank and ZBV, with and without memory caps); on larger problems it is a local
optimum of the makespan that is never worse than the bottleneck-optimal split.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from dynmo_lightning.balance.layout import validate_partition
from dynmo_lightning.balance.makespan import ZERO_BUBBLE, execute, lower_bound, rank_orders
from dynmo_lightning.balance.optimal import InfeasibleMemoryError
from dynmo_lightning.balance.partition import partition
from dynmo_lightning.balance.placement import stage_ranks

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
        schedule: a schedule of :data:`~dynmo_lightning.balance.makespan.SCHEDULES`.
        p2p: time of one hop between ranks.
        wgt: weight-gradient part of each layer's backward (zero-bubble ``W`` tasks); ``None``: 0.
        stages_per_rank: stages each rank holds.
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
    ) -> None:
        if len(fwd) != len(bwd) or (wgt is not None and len(wgt) != len(fwd)):
            raise ValueError(f"{len(fwd)} forward and {len(bwd)} backward times: give one of each per layer")
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

    def stage_times(self, split: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
        """Per-stage forward, backward and weight-part sums of ``split``."""
        bounds = np.concatenate([[0], np.cumsum(split)]).astype(int)
        return tuple(np.diff(p[bounds]).tolist() for p in self._prefix)  # type: ignore[return-value]

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


@functools.lru_cache(maxsize=256)
def _orders(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> tuple[tuple, ...]:
    return tuple(tuple(o) for o in rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank))


def makespan_split(
    model: StepModel,
    n_stages: int,
    *,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
    start: Sequence[int] | None = None,
) -> tuple[float, list[int]] | None:
    """The split of ``model``'s layers over ``n_stages`` with the smallest makespan found (see the module docstring).

    Args:
        model: the step model (costs, schedule, placement).
        n_stages: stages of the split (``stages_per_rank`` times the ranks).
        memory: memory each layer needs (with ``capacity``): every stage of the result fits.
        capacity: memory a stage may hold, one number or one per stage.
        start: the split to climb from; default the bottleneck-optimal one.

    Returns:
        ``(makespan, split)``, or ``None`` when no split fits in memory.
    """
    key = (
        n_stages,
        None if memory is None else tuple(memory),
        capacity if capacity is None or isinstance(capacity, (int, float)) else tuple(capacity),
        None if start is None else tuple(start),
    )
    if key not in model.plans:  # the policy asks again at every check while the costs stand
        model.plans[key] = _search(model, n_stages, memory, capacity, start)
    found = model.plans[key]
    return None if found is None else (found[0], list(found[1]))


def _search(
    model: StepModel,
    n_stages: int,
    memory: Sequence[float] | None,
    capacity: float | Sequence[float] | None,
    start: Sequence[int] | None,
) -> tuple[float, list[int]] | None:
    try:
        seed = partition(model.costs, n_stages, method="optimal", memory=memory, capacity=capacity)
    except InfeasibleMemoryError:
        return None
    caps = _caps(capacity, n_stages) if memory is not None else None
    mem = None if memory is None else np.concatenate([[0.0], np.cumsum(memory)])
    best_split = list(seed)
    best = model(best_split)
    if start is not None:
        start = validate_partition(start, model.n_layers)
        if len(start) == n_stages and _fits(start, mem, caps) and model(start) < best:
            best_split, best = list(start), model(start)
    best, best_split = _climb(model, best, best_split, mem, caps)
    return _branch_and_bound(model, n_stages, best, best_split, mem, caps)


def _climb(
    model: StepModel, best: float, best_split: list[int], mem: np.ndarray | None, caps: list[float] | None
) -> tuple[float, list[int]]:
    """Best-improvement local search over :func:`_neighbours` (bounded candidates are never simulated)."""
    while True:
        improved = None
        for candidate in _neighbours(best_split):
            if not _fits(candidate, mem, caps) or model.bound(candidate) >= best * (1 - TOLERANCE):
                continue
            t = model(candidate)
            if t < best * (1 - TOLERANCE) and (improved is None or t < improved[0]):
                improved = (t, candidate)
        if improved is None:
            return best, best_split
        best, best_split = improved


def _branch_and_bound(
    model: StepModel,
    n_stages: int,
    best: float,
    best_split: list[int],
    mem: np.ndarray | None,
    caps: list[float] | None,
) -> tuple[float, list[int]]:
    """Every split whose lower bound beats the incumbent, stage by stage, within :data:`NODE_BUDGET` nodes.

    A partial split (stages ``0..k`` fixed) is cut off when a rank's bound already reaches the incumbent: the
    forwards before its first stage plus ``M`` times the work of its stages fixed so far, or, for the ranks of the
    stages still open, ``M`` times their fixed work plus the layers left, shared as evenly as possible. Exhaustive
    (hence exact) when it ends within the budget; otherwise the incumbent stands.
    """
    n_layers, m = model.n_layers, model.n_microbatches
    ranks = stage_ranks(model.schedule, n_stages // model.stages_per_rank, model.stages_per_rank)
    n_ranks = max(ranks) + 1
    pf, pb, pw = (p.tolist() for p in model._prefix)
    cost = [f + b for f, b in zip(pf, pb, strict=True)]
    first = [ranks.index(r) for r in range(n_ranks)]
    # With one stage per rank the last backward of a stage still crosses the stages before it (lower_bound's tail).
    single = n_ranks == n_stages
    open_ranks = [sorted(set(ranks[k + 1 :])) for k in range(n_stages)]
    nodes, sims = 0, len(model._memo) + SIM_BUDGET
    split: list[int] = []
    load = [0.0] * n_ranks
    incumbent = [best, list(best_split)]

    def visit(stage: int, start: int) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > NODE_BUDGET or len(model._memo) > sims:
            return
        if stage == n_stages:
            t = model(split)
            if t < incumbent[0] * (1 - TOLERANCE):
                incumbent[0], incumbent[1] = t, list(split)
            return
        left, r, bar = n_stages - stage - 1, ranks[stage], incumbent[0] * (1 - TOLERANCE)
        ends = []
        for end in range(start + 1 if left else n_layers, n_layers - left + 1):
            if mem is not None and caps is not None and mem[end] - mem[start] > caps[stage]:
                break
            add = cost[end] - cost[start]
            own = pf[first[r]] + m * (load[r] + add)
            if single and pw[end] == pw[start]:
                own += pb[start] - pw[start]
            if own >= bar:
                break  # a longer stage only adds to this rank
            if left:
                fixed = sum(load[q] for q in open_ranks[stage]) + (add if r in open_ranks[stage] else 0.0)
                if m * (fixed + cost[n_layers] - cost[end]) / len(open_ranks[stage]) >= bar:
                    continue
            ends.append(end)
        # Nearest the incumbent's cut first: good splits are found early and bound the rest harder.
        target = sum(incumbent[1][: stage + 1])
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
