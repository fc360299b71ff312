"""Decentralised diffusion balancing: stages exchange boundary layers with their pipeline neighbours only.

One protocol, two drivers. :class:`DiffusionStage` is the state machine of ONE pipeline stage: it knows its own
layers (cost, memory and any extra numbers that ride along, e.g. forward/backward time and bytes) and, every round,
emits one fixed-size :class:`Card` to both neighbours and consumes the two cards they sent. :func:`diffuse` and
:func:`diffusion_rounds` drive all stages in one process with in-memory message passing (planning, the simulator,
tests); :func:`dynmo_lightning.pipeline.neighbours.run_stage` drives one stage per process with point-to-point
messages on the pipeline group (the balancer at runtime). Both run the same code, so they take the same rounds and
end on the same split.

The protocol runs in synchronous rounds. In round ``r`` only the boundaries ``p`` (between stages ``p`` and
``p + 1``) with ``p % 2 == r % 2`` may move, one layer at a time, so no stage gains or loses layers on both sides at
once and no layer skips a stage. A card carries what the neighbour needs to take the same decision on the boundary
the two share: the stage's load and memory, its layer count and end, its first and last layer (so a moved layer's
numbers travel with it), a push flag, a relay flag, the latest round it heard of activity, three reduction values
and two gather entries.

Besides layers, the stages diffuse a bottleneck bound ``B``: every stage runs its own copy of the exact search of
:class:`~dynmo_lightning.balance._search.BoundSearch`, fed with values all-reduced over neighbour links (each round
a stage combines its value with its neighbours'; after ``P - 1`` rounds all agree: max, min and "and" are
idempotent), so all copies propose the same bound. For a bound ``B`` (never below the largest layer cost) the
stages *settle*:

1. push phase: a stage (not the last) whose load exceeds ``B`` or whose memory exceeds the capacity passes its
   last layer to its right neighbour. When no stage pushes, every stage but the last fits, which puts every boundary
   at or left of ``T(B)``, the split a left-to-right greedy makes when each stage takes the longest block within
   ``B`` and the capacity but leaves one layer for each later stage. (Induction: a stage that starts at or left of
   ``T`` and fits ends at or left of ``T``, because the greedy's reach only grows when the start moves right.)
2. pull phase: a stage asks for its right neighbour's first layer when its block plus that layer fits and enough
   layers remain for the later stages; a one-layer stage whose only layer its left neighbour asked for asks its own
   right neighbour (it relays the request, so a run of one-layer stages never blocks the flow; requests name the
   layer, so a stale one is ignored). A request is granted when the boundary's turn comes and the neighbour has two
   or more layers. Boundaries only move right and never past ``T(B)``: a request from a stage at or left of ``T``
   shows the greedy's reach lies beyond its end. While the split differs from ``T(B)``, the leftmost stage that
   ends short of ``T(B)`` keeps asking, and its request is relayed to a stage with two or more layers, so some
   boundary moves within ``O(P)`` rounds; as moves only go right, the phase ends exactly at ``T(B)``.

``B`` is feasible iff the last stage of ``T(B)`` fits too (the greedy places as many layers as any split can). The
stages all-reduce three numbers: whether every stage fits, the largest load (the bottleneck reached) and the least
bound that would change ``T(B)`` - a stage's load plus its right neighbour's first layer where memory allows that
layer, or the last stage's whole load. Below that value ``T`` stays the same, so the bound stays infeasible. That is
exactly what the search needs to land on the optimum, see :class:`BoundSearch`: the protocol is *exact*.

Each phase ends by itself: stages tell neighbours the latest round in which they heard of any activity (a push, or
a request). One quiet round means the phase is over for good, and everyone learns of the last busy round within
``P - 1`` rounds, so every stage ends the phase in the same round: ``P`` rounds after the last activity. Finally a
*gather* phase of ``P - 1`` rounds pipelines one small entry per stage along the chain in both directions (each
card forwards one entry each way), so every stage learns the new split and per-stage sums - never a layer's cost.

Rounds (see :func:`round_bound`): ``(K + 2)(P - 1)`` reduction and gather rounds, plus ``K + 1`` settles of at most
``2P + 2 m_push + (P + 2)(m_pull + 1)`` rounds each, where ``K`` is the number of probes (at most
``2 + log2((B_0 - c_max) / delta)``, ``delta`` the least gap between two distinct block sums: 1 for integer costs)
and ``m`` the layer moves of a phase (each boundary moves one way per phase, so ``m <= (P - 1)(L - P)``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from dynmo_lightning.balance._search import BoundSearch
from dynmo_lightning.balance._validation import as_capacities, as_values
from dynmo_lightning.balance.layout import bottleneck, validate_partition
from dynmo_lightning.balance.optimal import InfeasibleMemoryError, require_memory_fit

REDUCE, PUSH, PULL, GATHER = "reduce", "push", "pull", "gather"

#: One layer as the protocol carries it: ``(cost, memory, *extras)``.
Layer = tuple[float, ...]


@dataclass(frozen=True)
class Card:
    """What one stage sends to both neighbours in a round (fixed size: it travels as one float64 tensor).

    Attributes:
        load: sum of its layers' costs.
        memory: sum of its layers' memory.
        size: its layer count.
        end: model index after its last layer.
        push: push phase: it passes its last layer right when its boundary's turn comes.
        relay: pull phase: it holds one layer, which its left neighbour asked for (it asks on regardless).
        heard: latest round it heard of activity in the phase.
        first: its first layer (a pull moves it left).
        last: its last layer (a push moves it right).
        values: reduction phase: its current three values.
        to_right: gather phase: the entry it forwards to the right (stage -1: none).
        to_left: gather phase: the entry it forwards to the left.
    """

    load: float
    memory: float
    size: int
    end: int
    push: bool
    relay: bool
    heard: int
    first: Layer
    last: Layer
    values: tuple[float, float, float]
    to_right: tuple[float, ...]
    to_left: tuple[float, ...]

    def encode(self) -> list[float]:
        """The card as a flat list of floats (see :meth:`decode`)."""
        head = [self.load, self.memory, self.size, self.end, float(self.push), float(self.relay), self.heard]
        return [float(x) for x in (*head, *self.first, *self.last, *self.values, *self.to_right, *self.to_left)]

    @classmethod
    def decode(cls, flat: Sequence[float], width: int) -> Card:
        """Rebuild a card from :meth:`encode`'s floats, for layers of ``width`` numbers."""
        v = [float(x) for x in flat]
        entry = _entry_width(width)
        cut = list(accumulate([7, width, width, 3, entry, entry]))
        if len(v) != cut[-1]:
            raise ValueError(f"a diffusion card of layers of {width} numbers has {cut[-1]} floats, got {len(v)}")
        return cls(v[0], v[1], int(v[2]), int(v[3]), v[4] != 0, v[5] != 0, int(v[6]), tuple(v[cut[0] : cut[1]]),
                   tuple(v[cut[1] : cut[2]]), (v[cut[2]], v[cut[2] + 1], v[cut[2] + 2]), tuple(v[cut[3] : cut[4]]),
                   tuple(v[cut[4] :]))  # fmt: skip


def card_width(width: int) -> int:
    """Floats in a card for layers of ``width`` numbers."""
    return 7 + 2 * width + 3 + 2 * _entry_width(width)


def _entry_width(width: int) -> int:
    return 2 + 3 * width  # stage, size, sums over the new, the received and the old layers


@dataclass(frozen=True)
class StageOutcome:
    """One stage's result, as every stage learns it in the gather phase.

    Attributes:
        size: its layer count in the new split.
        new: sums of each layer number (cost, memory, extras) over its new layers.
        received: the same sums over the layers it did not hold before (what migration sends it).
        old: the same sums over the layers it held before.
    """

    size: int
    new: tuple[float, ...]
    received: tuple[float, ...]
    old: tuple[float, ...]

    @classmethod
    def from_entry(cls, entry: Sequence[float], width: int) -> StageOutcome:
        """Read a gather entry ``(stage, size, *new, *received, *old)``."""
        sums = entry[2:]
        return cls(int(entry[1]), tuple(sums[:width]), tuple(sums[width : 2 * width]), tuple(sums[2 * width :]))


def require_outcome_fits(outcome: Sequence[StageOutcome], capacity: float | None) -> None:
    """Raise unless every stage of a protocol run's split holds at most ``capacity`` of memory.

    When no split fits, the protocol still ends (no bound is ever feasible, so the search gives up at its top) but on
    a split that breaks the capacity; the runtime cannot check feasibility first without gathering every layer's
    memory, so it checks the outcome, which every stage knows.

    Raises:
        InfeasibleMemoryError: naming the fullest stage and what it would hold.
    """
    if capacity is None or not outcome:
        return
    fullest = max(range(len(outcome)), key=lambda s: outcome[s].new[1])
    held = outcome[fullest].new[1]
    if held > capacity:
        raise InfeasibleMemoryError(
            f"balancer.memory_capacity={capacity:g}: no split of the {sum(o.size for o in outcome)} layers over "
            f"{len(outcome)} stages keeps every stage within it (diffusion ended with stage {fullest} holding "
            f"{held:g}); raise the capacity, use more stages, or lower the micro-batch size"
        )


Neighbours = tuple[Card | None, Card | None]


def _fold(values: Iterable[float]) -> float:
    """Left-to-right float sum: a block's sum plus its next layer IS the longer block's sum, bit for bit.

    So the left neighbour's test "my load plus your first layer fits" equals the test on the block it will hold, and
    both neighbours decide it alike from the card. Rounded addition is monotone in both arguments, so a block's sum
    never falls when it grows at either end: the greedy argument holds for these sums as for exact ones.
    """
    total = 0.0
    for x in values:
        total += x
    return total


_Op = Callable[[float, float], float]


class DiffusionStage:
    """The protocol as ONE pipeline stage runs it: a state machine that emits a card and consumes its neighbours'.

    Drive it round by round: send :attr:`card` to both neighbours, then call :meth:`step` with the cards the left
    and right neighbour sent in the same round (``None`` where there is no neighbour). When :attr:`card` is
    ``None`` the stage is done: :attr:`outcome` holds every stage's :class:`StageOutcome` (all stages finish in the
    same round). The stage never sees another stage's layers but the first/last one a neighbour shows on its card.

    Args:
        stage: its index in the pipeline.
        n_stages: stages of the pipeline.
        first: model index of its first layer.
        layers: its layers, ``(cost, memory, *extras)`` each, all of the same length (at least 2).
        n_layers: layers of the model.
        capacity: memory a stage may hold (the same for all stages).
    """

    def __init__(
        self, stage: int, n_stages: int, first: int, layers: Sequence[Sequence[float]], *, n_layers: int,
        capacity: float = math.inf,
    ) -> None:  # fmt: skip
        records = [tuple(float(x) for x in layer) for layer in layers]
        if not records or len({len(r) for r in records}) != 1 or len(records[0]) < 2:
            raise ValueError("a diffusion stage needs at least one layer, each (cost, memory, *extras) of one length")
        self.stage, self.n_stages, self.n_layers, self.capacity = stage, n_stages, n_layers, capacity
        self.first, self.layers, self.width = first, records, len(records[0])
        self._old = (first, first + len(records), self._sums(records))
        #: Phase of the round :attr:`card` is for; the bound the stage works against (``None`` before the search).
        self.phase, self.bound = REDUCE, None
        self.rounds = self.probes = 0
        self.outcome: list[StageOutcome] | None = None
        self._right_first: Layer | None = None
        self._program = self._run()
        self.card: Card | None = next(self._program, None)

    @property
    def end(self) -> int:
        """Model index after its last layer."""
        return self.first + len(self.layers)

    def step(self, left: Card | None, right: Card | None) -> None:
        """Take in the round's cards from the left and right neighbour and advance one round."""
        if self.card is None:
            raise RuntimeError(f"diffusion stage {self.stage} has finished; it takes no more rounds")
        self.rounds += 1
        if right is not None:
            self._right_first = right.first
        try:
            self.card = self._program.send((left, right))
        except StopIteration:
            self.card = None

    # ----------------------------------------------------------------------------------------------------------------
    def _run(self) -> Generator[Card, Neighbours, None]:
        if self.n_stages > 1:
            largest = max(layer[0] for layer in self.layers)
            largest, current, _ = yield from self._allreduce((largest, self._load(), 0.0), (max, max, max))
            # The largest layer is a lower bound; the current bottleneck a feasible first guess.
            search, feasible = BoundSearch(largest, (current,)), False
            # Every stage's copy of the search sees the same all-reduced values: all propose the same bounds.
            while not search.done:
                self.bound, self.probes = search.point(), self.probes + 1
                yield from self._settle()
                worst, grown, fits = yield from self._allreduce(self._report(), (max, min, min))
                feasible = bool(fits)
                search.record(feasible, worst if feasible else grown)
            # A feasible last probe left T(bound) = T(its bottleneck) = T(optimum); otherwise settle there.
            if not feasible:
                self.bound = search.hi
                yield from self._settle()
        self.outcome = yield from self._gather()

    def _settle(self) -> Generator[Card, Neighbours, None]:
        yield from self._phase(PUSH)
        yield from self._phase(PULL)

    def _allreduce(self, value: tuple[float, ...], ops: tuple[_Op, ...]) -> Generator[Card, Neighbours, tuple]:
        """Combine with both neighbours' values every round; after ``P - 1`` rounds every stage holds the result."""
        self.phase = REDUCE
        for _ in range(self.n_stages - 1):
            left, right = yield self._card(values=value)
            lv, rv = (left.values if left else value), (right.values if right else value)
            value = tuple(op(op(a, b), c) for op, a, b, c in zip(ops, lv, value, rv, strict=True))
        return value

    def _phase(self, kind: str) -> Generator[Card, Neighbours, None]:
        """One push or pull phase, until the stage detects (with all others, in the same round) that it is over."""
        self.phase = kind
        heard, asked = self.rounds, None  # latest activity heard of; the layer the left neighbour asked for
        while True:
            now = self.rounds + 1
            turn = now % 2
            if kind == PUSH:
                active = self.stage < self.n_stages - 1 and not self._fits()
                left, right = yield self._card(push=active, heard=heard)
                if active and self.stage % 2 == turn:
                    self.layers.pop()
                if left is not None and left.push and (self.stage - 1) % 2 == turn:
                    self.layers.insert(0, left.last)
                    self.first -= 1
            else:
                mine = self._card(relay=len(self.layers) == 1 and asked == self.first, heard=heard)
                left, right = yield mine
                active = right is not None and self._wants(mine, self.stage, right.first)
                by_left = left is not None and self._wants(left, self.stage - 1, mine.first)
                asked = left.end if left is not None and by_left else None
                if right is not None and active and self.stage % 2 == turn and right.size >= 2:
                    self.layers.append(right.first)
                if by_left and (self.stage - 1) % 2 == turn and mine.size >= 2:
                    self.layers.pop(0)
                    self.first += 1
            news = [now if active else heard, *(c.heard for c in (left, right) if c is not None)]
            heard = max(news)
            if heard < now - (self.n_stages - 1):
                return

    def _gather(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Pipeline one entry per stage along the chain both ways: ``P - 1`` rounds, one entry per card and way."""
        self.phase = GATHER
        mine = self._entry()
        table, blank = {self.stage: mine}, (-1.0,) + (0.0,) * (len(mine) - 1)
        for k in range(1, self.n_stages):
            out = {"to_right": table.get(self.stage - k + 1, blank), "to_left": table.get(self.stage + k - 1, blank)}
            left, right = yield self._card(**out)
            for entry in (left.to_right if left else blank, right.to_left if right else blank):
                if entry[0] >= 0:
                    table[int(entry[0])] = entry
        return [StageOutcome.from_entry(table[s], self.width) for s in range(self.n_stages)]

    # ----------------------------------------------------------------------------------------------------------------
    def _load(self) -> float:
        return _fold(layer[0] for layer in self.layers)

    def _memory(self) -> float:
        return _fold(layer[1] for layer in self.layers)

    def _fits(self) -> bool:
        assert self.bound is not None
        return self._load() <= self.bound and self._memory() <= self.capacity

    def _wants(self, card: Card, stage: int, nxt: Layer) -> bool:
        """Whether ``stage`` (showing ``card``) asks for the next layer ``nxt``: both neighbours decide it alike."""
        assert self.bound is not None
        if card.end >= self.n_layers - (self.n_stages - 1 - stage):
            return False  # every later stage still needs one layer
        if card.relay:
            return True  # relay: its only layer goes left, so it takes one from the right first
        return card.load + nxt[0] <= self.bound and card.memory + nxt[1] <= self.capacity

    def _report(self) -> tuple[float, float, float]:
        """This stage's share of a probe's outcome: load, least bound that would change its state, fits.

        A stage the bound stopped changes once the bound admits its next layer; the last stage, which holds what
        is left, once the bound admits its whole load. Memory-stopped stages never change with the bound.
        """
        load, memory = self._load(), self._memory()
        if self.stage == self.n_stages - 1:
            change = load if memory <= self.capacity else math.inf
        else:
            assert self._right_first is not None
            nxt = self._right_first
            change = load + nxt[0] if memory + nxt[1] <= self.capacity else math.inf
        return load, change, float(self._fits())

    @staticmethod
    def _sums(layers: Sequence[Layer]) -> tuple[float, ...]:
        return tuple(math.fsum(column) for column in zip(*layers, strict=True))

    def _entry(self) -> tuple[float, ...]:
        start, stop, old = self._old
        got = [layer for i, layer in enumerate(self.layers, self.first) if not start <= i < stop]
        nothing = (0.0,) * self.width
        received = self._sums(got) if got else nothing
        return (float(self.stage), float(len(self.layers)), *self._sums(self.layers), *received, *old)

    def _card(self, *, push: bool = False, relay: bool = False, heard: int = 0,
              values: tuple[float, ...] = (0.0, 0.0, 0.0), to_right: tuple[float, ...] | None = None,
              to_left: tuple[float, ...] | None = None) -> Card:  # fmt: skip
        blank = (-1.0,) + (0.0,) * (_entry_width(self.width) - 1)
        first, last, three = self.layers[0], self.layers[-1], (values[0], values[1], values[2])
        return Card(self._load(), self._memory(), len(self.layers), self.end, push, relay, heard, first, last, three,
                    to_right or blank, to_left or blank)  # fmt: skip


@dataclass(frozen=True)
class DiffusionResult:
    """Outcome of :func:`diffuse`.

    Attributes:
        layers_per_stage: final split.
        rounds: synchronous rounds used (layer exchanges, message-only rounds, reduction and gather rounds).
        bottleneck: largest stage load of the final split.
        converged: whether the protocol finished within ``max_rounds``.
        probes: bounds the search probed (``K`` of :func:`round_bound`).
        message_bytes: bytes one stage sends in a round to one neighbour (one card).

    """

    layers_per_stage: list[int]
    rounds: int
    bottleneck: float
    converged: bool
    probes: int = 0
    message_bytes: int = 0


@dataclass(frozen=True)
class DiffusionRound:
    """State after one synchronous round of the protocol.

    Attributes:
        index: round number, from 1; boundary ``p`` may move only in rounds with ``index % 2 == p % 2``.
        phase: ``"reduce"`` (all-reduce over neighbour links), ``"push"``, ``"pull"`` or ``"gather"``.
        bound: the bottleneck bound the stages work against, or ``None`` before they have agreed on one.
        layers_per_stage: split after the round.

    """

    index: int
    phase: str
    bound: float | None
    layers_per_stage: tuple[int, ...]


def round_bound(n_layers: int, n_stages: int, probes: int) -> int:
    """The most rounds the protocol takes for ``probes`` probes (tested: ``tests/balance/test_balance_diffusion.py``).

    Why. A phase ends ``P`` rounds after its last activity, and activity never resumes after a quiet round (nothing
    changed, so nothing becomes active). Push phase: an active stage stays active until it pushes (its load only
    grows before that) and pushes within two rounds, so it lasts at most ``P + 2 m``. Pull phase: while the split
    is not ``T(B)`` a request reaches a stage with two or more layers within ``P - 1`` relays and is granted within
    two more rounds, so it lasts at most ``P + (P + 2)(m + 1)``. Each boundary moves one way in a phase, so
    ``m <= (P - 1)(L - P)`` moves. Reductions: one per probe plus the first; the gather: one; ``P - 1`` rounds each.
    At most ``probes + 1`` settles. Worst case ``O(K P^2 L)``; in practice about ``3 P`` rounds per probe plus the
    layer moves.
    """
    p, moves = n_stages, (n_stages - 1) * (n_layers - n_stages)
    if p == 1:
        return 0
    settle = (p + 2 * moves) + (p + (p + 2) * (moves + 1))
    return (probes + 2) * (p - 1) + (probes + 1) * settle


def probe_bound(current: float, largest: float, gap: float) -> int:
    """The most probes the search takes from a feasible current bottleneck, for block sums at least ``gap`` apart.

    The first probe is the current bottleneck; every later one at least halves ``hi - lo`` (both ends are block
    sums), and two block sums closer than ``gap`` are equal.
    """
    spread = max(current - largest, 0.0) / gap
    return 2 + (math.ceil(math.log2(spread)) if spread > 1 else 0)


def stage_layers(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    memory: Sequence[float] | None = None,
    extras: Sequence[Sequence[float]] = (),
) -> list[list[Layer]]:
    """Each stage's layers ``(cost, memory, *extras)`` under a split (what each stage knows of its own layers)."""
    columns = [costs, memory if memory is not None else [0.0] * len(costs), *extras]
    rows = [tuple(float(c[i]) for c in columns) for i in range(len(costs))]
    ends = list(accumulate(layers_per_stage))
    return [rows[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def start_stages(layers: Sequence[Sequence[Layer]], capacity: float = math.inf) -> list[DiffusionStage]:
    """One :class:`DiffusionStage` per stage of a split given by each stage's layers (the in-memory driver's)."""
    n_layers, firsts = sum(len(x) for x in layers), [0, *accumulate(len(x) for x in layers)]
    return [
        DiffusionStage(s, len(layers), firsts[s], own, n_layers=n_layers, capacity=capacity)
        for s, own in enumerate(layers)
    ]


def drive(stages: Sequence[DiffusionStage]) -> Iterator[DiffusionRound]:
    """Run stages to the end in one process: every round each stage's card reaches its neighbours in memory."""
    last, index = len(stages) - 1, 0
    while stages[0].card is not None:
        cards = [stage.card for stage in stages]
        phase, bound = stages[0].phase, stages[0].bound
        for s, stage in enumerate(stages):
            stage.step(cards[s - 1] if s else None, cards[s + 1] if s < last else None)
        index += 1
        done = [stage.card is None for stage in stages]
        assert all(done) or not any(done), "stages disagree on the end of the protocol"
        yield DiffusionRound(index, phase, bound, tuple(len(stage.layers) for stage in stages))


def shared_capacity(capacities: Sequence[float] | None) -> float:
    """The one memory capacity all stages share (``inf`` for none); the protocol cannot take per-stage ones."""
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


def _stages(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    memory: Sequence[float] | None,
    capacity: float | Sequence[float] | None,
) -> list[DiffusionStage]:
    values = as_values(costs, "costs")
    sizes = validate_partition(layers_per_stage, values.size)
    limits = as_capacities(memory, capacity, values.size, len(sizes))
    shared = shared_capacity(None if limits is None else limits[1].tolist())
    require_memory_fit(limits, values.size, len(sizes))
    layer_memory = None if limits is None else limits[0].tolist()
    return start_stages(stage_layers(values.tolist(), sizes, layer_memory), shared)


def diffusion_rounds(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
) -> Iterator[DiffusionRound]:
    """Run the neighbour-only protocol round by round in one process (see the module docstring).

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
    return drive(_stages(costs, layers_per_stage, memory, capacity))


def diffuse(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    max_rounds: int | None = None,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
) -> DiffusionResult:
    """Re-balance a split by the decentralised neighbour-only diffusion protocol, simulated in one process.

    Guarantee (exact): the protocol always finishes, and it finishes on an optimal split - the bottleneck equals
    that of ``partition(costs, n, method="optimal")``, and the split is the same lexicographically largest one
    (exactly for integer-valued costs; for general floats up to rounding, since stages add their own layers
    left to right while the central planner uses prefix sums). The argument is in the module docstring; the
    rounds are bounded by :func:`round_bound`.

    Intermediate rounds are planning state: a relayed request can leave a stage above the bound (or the capacity)
    for a few rounds. Only the final split is meant to be applied.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: starting split.
        max_rounds: stop after this many rounds (``None``: run to the end).
        memory: memory each layer needs, or ``None``.
        capacity: memory one stage may hold; the protocol needs one value shared by all stages.

    Returns:
        The final split, the rounds used, its bottleneck, whether the protocol finished, the probes and card size.

    Raises:
        ValueError: on invalid arguments, a negative ``max_rounds``, or capacities that differ between stages.
        InfeasibleMemoryError: if no split respects the capacity.

    """
    if max_rounds is not None and (isinstance(max_rounds, bool) or operator.index(max_rounds) < 0):
        raise ValueError(f"max_rounds must be None or an integer >= 0, got {max_rounds!r}")
    stages = _stages(costs, layers_per_stage, memory, capacity)
    steps = drive(stages)
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
    width = 8 * card_width(stages[0].width) if len(stages) > 1 else 0
    return DiffusionResult(sizes, rounds, bottleneck(costs, sizes), converged, stages[0].probes, width)
