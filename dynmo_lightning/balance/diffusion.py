"""Decentralised diffusion balancing: stages exchange boundary layers with their pipeline neighbours only.

The protocol runs in synchronous rounds. In a round every stage looks only at a :class:`_View`: its own layers
(their costs and memory travel with them), its right neighbour's first layer and layer count, and the one-hop
messages its neighbours sent in the previous round. Layers move one at a time across a boundary, and in round ``r``
only the boundaries ``p`` (between stages ``p`` and ``p + 1``) with ``p % 2 == r % 2`` may move, so no stage gains
or loses layers on both sides at once and no layer skips a stage.

Besides layers, the stages diffuse a bottleneck bound ``B``: every stage runs its own copy of the exact search of
:class:`~dynmo_lightning.balance._search.BoundSearch`, fed with values all-reduced over neighbour links, so all
copies propose the same bound. For a bound ``B`` (never below the largest layer cost) the stages *settle*:

1. push phase: a stage (not the last) whose load exceeds ``B`` or whose memory exceeds the capacity passes its
   last layer to its right neighbour. When no stage pushes, every stage but the last fits, which puts every boundary
   at or left of ``T(B)``, the split a left-to-right greedy makes when each stage takes the longest block within
   ``B`` and the capacity but leaves one layer for each later stage. (Induction: a stage that starts at or left of
   ``T`` and fits ends at or left of ``T``, because the greedy's reach only grows when the start moves right.)
2. pull phase: a stage asks for its right neighbour's first layer when its block plus that layer fits and enough
   layers remain for the later stages; a one-layer stage whose only layer its left neighbour asked for asks its own
   right neighbour (it relays the request, so a run of one-layer stages never blocks the flow; requests name the
   layer, so a stale one is ignored). A request is
   granted when the boundary's turn comes and the neighbour has two or more layers. Boundaries only move right and
   never past ``T(B)``: a request from a stage at or left of ``T`` shows the greedy's reach lies beyond its end.
   While the split differs from ``T(B)``, the leftmost stage that ends short of ``T(B)`` keeps asking, and its
   request is relayed to a stage with two or more layers, so some boundary moves within ``O(P)`` rounds; as moves
   only go right, the phase ends exactly at ``T(B)``.

``B`` is feasible iff the last stage of ``T(B)`` fits too (the greedy places as many layers as any split can). The
stages all-reduce three numbers: whether every stage fits, the largest load (the bottleneck reached) and the least
bound that would change ``T(B)`` - a stage's load plus its right neighbour's first layer where memory allows that
layer, or the last stage's whole load. Below that value ``T`` stays the same, so the bound stays infeasible. That is
exactly what the search needs to land on the optimum, see :class:`BoundSearch`.

Each phase ends by itself: stages tell neighbours the latest round in which they heard of any activity (a push, or
a request). One quiet round means the phase is over for good, and everyone learns of the last busy round within
``P - 1`` rounds, so every stage ends the phase in the same round: ``P`` rounds after the last activity.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from dynmo_lightning.balance._search import BoundSearch
from dynmo_lightning.balance._validation import as_capacities, as_values
from dynmo_lightning.balance.layout import bottleneck, validate_partition
from dynmo_lightning.balance.optimal import require_memory_fit

REDUCE, PUSH, PULL = "reduce", "push", "pull"


@dataclass(frozen=True)
class DiffusionResult:
    """Outcome of :func:`diffuse`.

    Attributes:
        layers_per_stage: final split.
        rounds: synchronous rounds used (layer exchanges, message-only rounds and all-reduce rounds).
        bottleneck: largest stage load of the final split.
        converged: whether the protocol finished within ``max_rounds``.

    """

    layers_per_stage: list[int]
    rounds: int
    bottleneck: float
    converged: bool


@dataclass(frozen=True)
class DiffusionRound:
    """State after one synchronous round of the protocol.

    Attributes:
        index: round number, from 1; boundary ``p`` may move only in rounds with ``index % 2 == p % 2``.
        phase: ``"reduce"`` (all-reduce over neighbour links), ``"push"`` or ``"pull"``.
        bound: the bottleneck bound the stages work against, or ``None`` before they have agreed on one.
        layers_per_stage: split after the round.

    """

    index: int
    phase: str
    bound: float | None
    layers_per_stage: tuple[int, ...]


@dataclass(frozen=True)
class _View:
    """All one stage may look at in one round."""

    stage: int
    first: int  # model index of its first layer
    costs: tuple[float, ...]  # its own layers
    memory: tuple[float, ...]
    next_cost: float | None  # right neighbour's first layer (None for the last stage)
    next_memory: float | None
    right_size: int  # right neighbour's layer count
    left_want: int | None  # layer the left neighbour asked for in the previous round

    @property
    def end(self) -> int:
        return self.first + len(self.costs)


@dataclass(frozen=True)
class _Rules:
    """One stage's decisions; ``bound`` is that stage's own copy of the agreed bound."""

    bound: float
    capacity: float
    n_layers: int
    n_stages: int

    def fits(self, costs: Sequence[float], memory: Sequence[float]) -> bool:
        return math.fsum(costs) <= self.bound and math.fsum(memory) <= self.capacity

    def pushes(self, view: _View) -> bool:
        return view.next_cost is not None and not self.fits(view.costs, view.memory)

    def wants(self, view: _View) -> bool:
        if view.next_memory is None or view.next_cost is None:
            return False
        if view.end >= self.n_layers - (self.n_stages - 1 - view.stage):
            return False  # every later stage still needs one layer
        if len(view.costs) == 1 and view.left_want == view.first:
            return True  # relay: our only layer goes left, so take one from the right first
        return self.fits((*view.costs, view.next_cost), (*view.memory, view.next_memory))

    def report(self, view: _View) -> tuple[float, float, bool]:
        """Return this stage's share of a probe's outcome: load, least bound that would change its state, fits.

        A stage the bound stopped changes once the bound admits its next layer; the last stage, which holds what
        is left, once the bound admits its whole load. Memory-stopped stages never change with the bound.
        """
        if view.next_memory is None or view.next_cost is None:
            costs, memory = view.costs, view.memory
        else:
            costs, memory = (*view.costs, view.next_cost), (*view.memory, view.next_memory)
        change = math.fsum(costs) if math.fsum(memory) <= self.capacity else math.inf
        return math.fsum(view.costs), change, self.fits(view.costs, view.memory)


Combine = Callable[[tuple, tuple, tuple], tuple]


def _combiner(*ops: Callable[[object, object], object]) -> Combine:
    def combine(left: tuple, own: tuple, right: tuple) -> tuple:
        return tuple(op(op(a, b), c) for op, a, b, c in zip(ops, left, own, right, strict=True))

    return combine


class _Pipeline:
    """The simulator: where the layers are and the round clock; every decision sees only a :class:`_View`."""

    def __init__(self, costs: list[float], memory: list[float], capacity: float, sizes: list[int]) -> None:
        self.costs, self.memory, self.capacity = costs, memory, capacity
        self.ends = list(accumulate(sizes))
        self.n_stages, self.n_layers = len(sizes), len(costs)
        self.round = 0

    def _view(self, stage: int, left_want: int | None) -> _View:
        start = self.ends[stage - 1] if stage else 0
        end = self.ends[stage]
        last = stage == self.n_stages - 1
        return _View(
            stage=stage,
            first=start,
            costs=tuple(self.costs[start:end]),
            memory=tuple(self.memory[start:end]),
            next_cost=None if last else self.costs[end],
            next_memory=None if last else self.memory[end],
            right_size=0 if last else self.ends[stage + 1] - end,
            left_want=left_want,
        )

    def _views(self, wants: Sequence[int | None]) -> list[_View]:
        return [self._view(stage, wants[stage - 1] if stage else None) for stage in range(self.n_stages)]

    def _tick(self, phase: str, bound: float | None) -> DiffusionRound:
        self.round += 1
        sizes = (b - a for a, b in zip([0, *self.ends[:-1]], self.ends, strict=True))
        return DiffusionRound(self.round, phase, bound, tuple(sizes))

    def allreduce(
        self, values: list[tuple], combine: Combine, bound: float | None
    ) -> Generator[DiffusionRound, None, list[tuple]]:
        """Every stage combines its value with its neighbours' each round; after ``P - 1`` rounds all agree."""
        last = self.n_stages - 1
        for _ in range(last):
            values = [
                combine(values[max(stage - 1, 0)], values[stage], values[min(stage + 1, last)])
                for stage in range(self.n_stages)
            ]
            yield self._tick(REDUCE, bound)
        return values

    def phase(self, phase: str, rules: list[_Rules]) -> Iterator[DiffusionRound]:
        """Run one push or pull phase until every stage detects that it is over."""
        n, last = self.n_stages, self.n_stages - 1
        heard = [self.round] * n  # latest round with activity each stage knows of; none yet this phase
        sent: list[int | None] = [None] * n  # requests sent last round: the layer asked for
        while True:
            turn = (self.round + 1) % 2
            views = self._views(sent)
            if phase == PUSH:
                active = [rule.pushes(view) for rule, view in zip(rules, views, strict=True)]
                steps = [-1 if active[p] and p % 2 == turn else 0 for p in range(last)]
            else:
                active = [rule.wants(view) for rule, view in zip(rules, views, strict=True)]
                steps = [1 if active[p] and p % 2 == turn and views[p].right_size >= 2 else 0 for p in range(last)]
                sent = [view.end if want else None for view, want in zip(views, active, strict=True)]
            for boundary, step in enumerate(steps):
                self.ends[boundary] += step
            now = self.round + 1
            heard = [
                max(now if active[p] else heard[p], heard[max(p - 1, 0)], heard[min(p + 1, last)]) for p in range(n)
            ]
            yield self._tick(phase, rules[0].bound)
            over = [latest < now - last for latest in heard]
            if any(over):
                assert all(over), "stages disagree on the end of a phase"
                return

    def run(self) -> Iterator[DiffusionRound]:
        """Run the whole protocol: agree on starting facts, search the bound by settling, settle on the optimum."""
        views = self._views([None] * self.n_stages)
        facts = yield from self.allreduce(
            [(max(view.costs), math.fsum(view.costs)) for view in views], _combiner(max, max), None
        )
        # Per stage: the largest layer is a lower bound; the current bottleneck a feasible first guess.
        searches = [BoundSearch(largest, (current,)) for largest, current in facts]
        feasible = False
        # Every copy of the search sees the same all-reduced values, so all propose the same bounds and end together.
        while not searches[0].done:
            rules = self._rules([search.point() for search in searches])
            yield from self._settle(rules)
            views = self._views([None] * self.n_stages)
            outcome = yield from self.allreduce(
                [rule.report(view) for rule, view in zip(rules, views, strict=True)],
                _combiner(max, min, operator.and_),
                rules[0].bound,
            )
            for search, (worst, grown, feasible) in zip(searches, outcome, strict=True):
                search.record(feasible, worst if feasible else grown)
        # A feasible last probe left T(bound) = T(its bottleneck) = T(optimum); otherwise settle there.
        if not feasible:
            yield from self._settle(self._rules([search.hi for search in searches]))

    def _rules(self, bounds: Sequence[float]) -> list[_Rules]:
        return [_Rules(bound, self.capacity, self.n_layers, self.n_stages) for bound in bounds]

    def _settle(self, rules: list[_Rules]) -> Iterator[DiffusionRound]:
        yield from self.phase(PUSH, rules)
        yield from self.phase(PULL, rules)


def _shared_capacity(capacities: Sequence[float] | None) -> float:
    if capacities is None:
        return math.inf
    distinct = set(capacities)
    if len(distinct) > 1:
        raise ValueError(
            f"diffusion needs one capacity shared by all stages, got {list(capacities)}: with per-stage "
            "capacities a greedy cannot decide feasibility once every stage must hold a layer; use "
            "partition(method='optimal') for per-stage capacities"
        )
    return distinct.pop()


def diffusion_rounds(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
) -> Iterator[DiffusionRound]:
    """Run the neighbour-only protocol round by round (see the module docstring).

    Arguments are checked before the first round, when this function is called.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: starting split.
        memory: memory each layer needs, or ``None``.
        capacity: memory one stage may hold (a number, or a per-stage list whose entries are all equal).

    Returns:
        An iterator of :class:`DiffusionRound`, one per round; it ends when the protocol has finished (at once for
        a single stage).

    Raises:
        ValueError: on invalid arguments or capacities that differ between stages.
        InfeasibleMemoryError: if no split respects the capacity.

    """
    values = as_values(costs, "costs")
    sizes = validate_partition(layers_per_stage, values.size)
    limits = as_capacities(memory, capacity, values.size, len(sizes))
    shared = _shared_capacity(None if limits is None else limits[1].tolist())
    require_memory_fit(limits, values.size, len(sizes))
    layer_memory = [0.0] * values.size if limits is None else limits[0].tolist()
    if len(sizes) == 1:
        return iter(())
    return _Pipeline(values.tolist(), layer_memory, shared, sizes).run()


def diffuse(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    max_rounds: int | None = None,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
) -> DiffusionResult:
    """Re-balance a split by the decentralised neighbour-only diffusion protocol.

    Guarantee: the protocol always finishes, and it finishes on an optimal split - the bottleneck equals that of
    ``partition(costs, n, method="optimal")``, and the split is the same lexicographically largest one (exactly
    for integer-valued costs; for general floats up to rounding, since stages add their own layers with
    :func:`math.fsum` while the central planner uses prefix sums). The argument is in the module docstring: for
    each probed bound the push and pull phases end exactly at the greedy split ``T(B)``, whose last stage fits iff
    the bound is feasible, and the stages share one exact bound search. Rounds: each settle costs its layer moves
    plus about ``2P`` detection rounds, each probe ``P - 1`` more all-reduce rounds, and the search needs a few
    probes per bit of precision separating the optimum from the next block sum.

    Intermediate rounds are planning state: a relayed request can leave a stage above the bound (or the capacity)
    for a few rounds. Only the final split is meant to be applied.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: starting split.
        max_rounds: stop after this many rounds (``None``: run to the end).
        memory: memory each layer needs, or ``None``.
        capacity: memory one stage may hold; the protocol needs one value shared by all stages.

    Returns:
        The final split, the rounds used, its bottleneck and whether the protocol finished.

    Raises:
        ValueError: on invalid arguments, a negative ``max_rounds``, or capacities that differ between stages.
        InfeasibleMemoryError: if no split respects the capacity.

    """
    if max_rounds is not None and (isinstance(max_rounds, bool) or operator.index(max_rounds) < 0):
        raise ValueError(f"max_rounds must be None or an integer >= 0, got {max_rounds!r}")
    steps = diffusion_rounds(costs, layers_per_stage, memory=memory, capacity=capacity)
    sizes = validate_partition(layers_per_stage, len(costs))
    rounds = 0
    while max_rounds is None or rounds < max_rounds:
        step = next(steps, None)
        if step is None:
            converged = True
            break
        rounds += 1
        sizes = list(step.layers_per_stage)
    else:
        converged = next(steps, None) is None
    return DiffusionResult(sizes, rounds, bottleneck(costs, sizes), converged)
