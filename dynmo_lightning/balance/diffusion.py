"""Decentralised diffusion balancing: stages exchange boundary layers with their pipeline neighbours only.

One protocol, two drivers. :class:`DiffusionStage` is the state machine of ONE pipeline stage: it knows its own
layers (cost, memory and any extra numbers that ride along, e.g. forward/backward time and bytes) and, every round,
emits one fixed-size :class:`Card` to both neighbours and consumes the two cards they sent. :func:`diffuse` and
:func:`diffusion_rounds` drive all stages in one process with in-memory message passing (planning, the simulator,
tests); :func:`dynmo_lightning.pipeline.neighbours.run_stage` drives one stage per process with point-to-point
messages on the pipeline group (the balancer at runtime). Both run the same code, so they take the same rounds and
end on the same split.

Two modes. ``"exact"`` (below) ends on the optimal split, in about a dozen probes of ``~3 P`` rounds each.
``"sweep"`` (:mod:`~dynmo_lightning.balance.sweep`) scans prefix sums once, cuts at equal shares locally and floods
the resulting pieces: about ``2 P`` rounds, bottleneck below the optimum plus the largest layer cost. Both use the
same cards, drivers and outcome.

The exact protocol runs in synchronous rounds. In round ``r`` only the boundaries ``p`` (between stages ``p`` and
``p + 1``) with ``p % 2 == r % 2`` may move, one layer at a time, so no stage gains or loses layers on both sides at
once and no layer skips a stage. A card carries what the neighbour needs to take the same decision on the boundary
the two share: the stage's load and memory, its layer count and end, its first and last layer (so a moved layer's
numbers travel with it), a push flag, a relay flag, the latest round it heard of activity, three reduction values
and a lane of entries each way (one gather entry in exact mode; prefix sums and pieces in sweep mode).

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
from bisect import bisect_right
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

import numpy as np

from dynmo_lightning.balance._search import BoundSearch
from dynmo_lightning.balance._validation import as_capacities, as_values
from dynmo_lightning.balance.layout import bottleneck, validate_partition
from dynmo_lightning.balance.optimal import InfeasibleMemoryError, require_memory_fit
from dynmo_lightning.balance.sweep import SLOTS, final_cuts, flood_rounds, raw_cuts, share, sizes_of

REDUCE, PUSH, PULL, GATHER, SCAN, FLOOD = "reduce", "push", "pull", "gather", "scan", "flood"

#: Modes of the protocol: ``"exact"`` ends on the optimal split; ``"sweep"`` (:mod:`~dynmo_lightning.balance.sweep`)
#: ends within one layer's cost of it in ``~2 P`` rounds.
MODES = EXACT, SWEEP = ("exact", "sweep")

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
        to_right: gather, scan and flood phases: the entries it forwards to the right (a lane of at most
            ``slots`` entries; empty: none).
        to_left: the same to the left.
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
    to_right: tuple[tuple[float, ...], ...] = ()
    to_left: tuple[tuple[float, ...], ...] = ()

    def encode(self, slots: int = 1) -> list[float]:
        """The card as a flat list of floats, each lane padded to ``slots`` entries (see :meth:`decode`)."""
        head = [self.load, self.memory, self.size, self.end, float(self.push), float(self.relay), self.heard]
        lanes = [x for lane in (self.to_right, self.to_left) for x in _pad(lane, len(self.first), slots)]
        return [float(x) for x in (*head, *self.first, *self.last, *self.values, *lanes)]

    @classmethod
    def decode(cls, flat: Sequence[float], width: int, slots: int = 1) -> Card:
        """Rebuild a card from :meth:`encode`'s floats, for layers of ``width`` numbers and lanes of ``slots``."""
        v = [float(x) for x in flat]
        entry = _entry_width(width)
        cut = list(accumulate([7, width, width, 3, slots * entry, slots * entry]))
        if len(v) != cut[-1]:
            raise ValueError(f"a diffusion card of layers of {width} numbers has {cut[-1]} floats, got {len(v)}")
        lanes = [[tuple(v[a + i * entry : a + (i + 1) * entry]) for i in range(slots)] for a in (cut[3], cut[4])]
        right, left = (tuple(e for e in lane if e[0] >= 0) for lane in lanes)  # blank entries start with -1
        return cls(v[0], v[1], int(v[2]), int(v[3]), v[4] != 0, v[5] != 0, int(v[6]), tuple(v[cut[0] : cut[1]]),
                   tuple(v[cut[1] : cut[2]]), (v[cut[2]], v[cut[2] + 1], v[cut[2] + 2]), right, left)  # fmt: skip


def card_width(width: int, slots: int = 1) -> int:
    """Floats in a card for layers of ``width`` numbers and lanes of ``slots`` entries."""
    return 7 + 2 * width + 3 + 2 * slots * _entry_width(width)


def _entry_width(width: int) -> int:
    # gather: stage, size, sums over the new, the received and the old layers; sweep pieces are shorter
    return 2 + 3 * width


def _pad(lane: Sequence[Sequence[float]], width: int, slots: int) -> list[float]:
    """A lane as ``slots`` entries of :func:`_entry_width` floats; blank entries start with ``-1``."""
    if len(lane) > slots:
        raise ValueError(f"a lane of {len(lane)} entries does not fit a card of {slots} slots")
    entry = _entry_width(width)
    blank = [-1.0] + [0.0] * (entry - 1)
    return [x for e in lane for x in (*e, *[0.0] * (entry - len(e)))] + blank * (slots - len(lane))


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


def _fold(values: Iterable[float], start: float = 0.0) -> float:
    """Left-to-right float sum: a block's sum plus its next layer IS the longer block's sum, bit for bit.

    So the left neighbour's test "my load plus your first layer fits" equals the test on the block it will hold, and
    both neighbours decide it alike from the card. Rounded addition is monotone in both arguments, so a block's sum
    never falls when it grows at either end: the greedy argument holds for these sums as for exact ones.
    """
    total = start
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
        mode: ``"exact"`` (the bound search above: the optimal split) or ``"sweep"`` (equal-share cuts from prefix
            sums, within one layer's cost of the optimum in about ``2 P`` rounds; see
            :mod:`~dynmo_lightning.balance.sweep`). Every stage of a run must use the same mode.
    """

    def __init__(
        self, stage: int, n_stages: int, first: int, layers: Sequence[Sequence[float]], *, n_layers: int,
        capacity: float = math.inf, mode: str = EXACT,
    ) -> None:  # fmt: skip
        records = [tuple(float(x) for x in layer) for layer in layers]
        if not records or len({len(r) for r in records}) != 1 or len(records[0]) < 2:
            raise ValueError("a diffusion stage needs at least one layer, each (cost, memory, *extras) of one length")
        if mode not in MODES:
            raise ValueError(f"diffusion mode {mode!r} is not one of {list(MODES)}")
        self.stage, self.n_stages, self.n_layers, self.capacity = stage, n_stages, n_layers, capacity
        #: Entries per card lane: one in exact mode, :data:`~dynmo_lightning.balance.sweep.SLOTS` in sweep mode.
        self.mode, self.slots = mode, SLOTS if mode == SWEEP else 1
        self.first, self.layers, self.width = first, records, len(records[0])
        self._old = (first, first + len(records), self._sums(records))
        #: Phase of the round :attr:`card` is for; the bound the stage works against (``None`` before the search).
        self.phase, self.bound = REDUCE, None
        self.rounds = self.probes = 0
        self.outcome: list[StageOutcome] | None = None
        self._right_first: Layer | None = None
        self._held_key: tuple[int, int] | None = None
        self._held_sums = (0.0, 0.0)
        self._program = self._run()
        self.card: Card | None = next(self._program, None)

    @property
    def end(self) -> int:
        """Model index after its last layer."""
        return self.first + len(self.layers)

    @property
    def size(self) -> int:
        """Its layer count: in the protocol's state while running, in the agreed split once finished.

        (The sweep mode moves no layer records between stages while it plans; the exact mode does.)
        """
        return len(self.layers) if self.outcome is None else self.outcome[self.stage].size

    @property
    def card_floats(self) -> int:
        """Floats of one encoded card of this run (:meth:`Card.encode` with :attr:`slots`)."""
        return card_width(self.width, self.slots)

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
        if self.n_stages > 1 and self.mode == SWEEP:
            outcome = yield from self._sweep()
            if all(o.new[1] <= self.capacity for o in outcome):
                self.outcome = outcome
                return
            # The equal-share cut ignores memory: every stage sees the breach in the sums and falls back alike.
        if self.n_stages > 1:
            yield from self._exact()
        self.outcome = yield from self._gather()

    def _exact(self) -> Generator[Card, Neighbours, None]:
        """The bound search: probes of settles and reductions until the split is the optimal one."""
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

    def _sweep(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """The sweep mode (:mod:`~dynmo_lightning.balance.sweep`): scan, local cut, flood (twice if a cut moved)."""
        costs, p = [layer[0] for layer in self.layers], self.n_stages
        offset, total = yield from self._scan(costs)
        raw, at = [], offset  # runs of its layers with the same equal share: (share, first index, layers)
        for index, layer in enumerate(self.layers, self.first):
            h = share(at + layer[0] / 2, total, p)
            at += layer[0]
            if raw and raw[-1][0] == h:
                raw[-1][2].append(layer)
            else:
                raw.append((h, index, [layer]))
        pieces = yield from self._flood([self._piece(start, run, h) for h, start, run in raw])
        cuts = final_cuts(raw_cuts(pieces, p, self.n_layers), self.n_layers)
        if _stages_of(pieces, cuts) != [int(piece[3]) for piece in pieces]:
            # Huge layers moved a cut off its equal share: cut its own layers at the final cuts and flood again.
            bounds = sorted({self.first, self.end, *(c for c in cuts if self.first < c < self.end)})
            own = [self._piece(a, self.layers[a - self.first : b - self.first], bisect_right(cuts, a))
                   for a, b in pairwise(bounds)]  # fmt: skip
            pieces = yield from self._flood(own)
        return self._tally(pieces, cuts)

    def _scan(self, costs: list[float]) -> Generator[Card, Neighbours, tuple[float, float]]:
        """``P - 1`` rounds: prefix sums flow right, suffix sums left; returns ``(C(first), S)``."""
        self.phase = SCAN
        last = self.n_stages - 1
        offset, after = (0.0 if self.stage == 0 else None), (0.0 if self.stage == last else None)
        out_right = ((0.0, _fold(costs)),) if offset is not None else ()
        out_left = ((0.0, _fold(costs) + after),) if after is not None else ()
        for _ in range(last):
            left, right = yield self._card(to_right=out_right, to_left=out_left)
            if offset is None and left is not None and left.to_right:
                offset = left.to_right[0][1]
                out_right = ((0.0, _fold(costs, offset)),)
            if after is None and right is not None and right.to_left:
                after = right.to_left[0][1]
                out_left = ((0.0, _fold(costs) + after),)
        assert offset is not None and after is not None, "the scan reaches every stage within P - 1 rounds"
        return offset, _fold(costs, offset) + after

    def _piece(self, start: int, run: Sequence[Layer], new: int) -> tuple[float, ...]:
        """A run of its layers: ``(start, end, old stage, new stage, *sums)``."""
        return (float(start), float(start + len(run)), float(self.stage), float(new), *self._sums(run))

    def _flood(self, mine: list[tuple[float, ...]]) -> Generator[Card, Neighbours, list[tuple[float, ...]]]:
        """Pass pieces along the chain both ways, :data:`SLOTS` per card and way, until every stage has all."""
        self.phase = FLOOD
        keep = 4 + self.width  # a decoded entry is padded to the gather's width
        table = {int(piece[0]): piece for piece in mine}
        # What is still to forward each way (own pieces, then what arrives from the other side), and how far sent.
        queues, sent = (list(mine), list(mine)), [0, 0]
        ends = (self.stage == self.n_stages - 1, self.stage == 0)
        for _ in range(flood_rounds(self.n_stages)):
            lanes = []
            for way, (queue, end) in enumerate(zip(queues, ends, strict=True)):
                lanes.append(() if end else tuple(queue[sent[way] : sent[way] + self.slots]))
                sent[way] += len(lanes[-1])
            left, right = yield self._card(to_right=lanes[0], to_left=lanes[1])
            arrived = (left.to_right if left else (), right.to_left if right else ())
            for lane, queue in zip(arrived, queues, strict=True):
                for entry in lane:
                    piece = entry if len(entry) == keep else entry[:keep]
                    table[int(piece[0])] = piece
                    queue.append(piece)
        pieces = [table[k] for k in sorted(table)]
        if [int(x[0]) for x in pieces[1:]] != [int(x[1]) for x in pieces[:-1]] or pieces[-1][1] != self.n_layers:
            raise RuntimeError(f"diffusion stage {self.stage}: the flood left a gap in the pieces of the model")
        return pieces

    def _tally(self, pieces: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[StageOutcome]:
        """Every stage's outcome from the pieces (each tagged with its old and new stage) and the final cuts."""
        table = np.asarray(pieces, dtype=np.float64)
        was, now, sums = table[:, 2].astype(np.int64), table[:, 3].astype(np.int64), table[:, 4:]
        moved = (was != now).astype(np.float64)

        def per_stage(stage: np.ndarray, weight: np.ndarray | float = 1.0) -> list[list[float]]:
            columns = [np.bincount(stage, weights=column * weight, minlength=self.n_stages) for column in sums.T]
            return np.stack(columns, axis=1).tolist()

        new, received, old = per_stage(now), per_stage(now, moved), per_stage(was)
        sizes = sizes_of(cuts, self.n_layers)
        return [StageOutcome(sizes[s], tuple(new[s]), tuple(received[s]), tuple(old[s])) for s in range(self.n_stages)]

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
        table = {self.stage: self._entry()}
        for k in range(1, self.n_stages):
            lanes = (table.get(self.stage - k + 1), table.get(self.stage + k - 1))
            left, right = yield self._card(to_right=_lane(lanes[0]), to_left=_lane(lanes[1]))
            for entry in (*(left.to_right if left else ()), *(right.to_left if right else ())):
                table[int(entry[0])] = entry
        return [StageOutcome.from_entry(table[s], self.width) for s in range(self.n_stages)]

    # ----------------------------------------------------------------------------------------------------------------
    def _load(self) -> float:
        return self._held()[0]

    def _memory(self) -> float:
        return self._held()[1]

    def _held(self) -> tuple[float, float]:
        """Load and memory of its layers, added up again only when they changed (a card is built every round).

        Its layers are always the model's ``[first, end)``, so that range names what it holds.
        """
        key = (self.first, len(self.layers))
        if self._held_key != key:
            self._held_key = key
            self._held_sums = (_fold(x[0] for x in self.layers), _fold(x[1] for x in self.layers))
        return self._held_sums

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
              values: tuple[float, ...] = (0.0, 0.0, 0.0), to_right: tuple[tuple[float, ...], ...] = (),
              to_left: tuple[tuple[float, ...], ...] = ()) -> Card:  # fmt: skip
        first, last, three = self.layers[0], self.layers[-1], (values[0], values[1], values[2])
        return Card(self._load(), self._memory(), len(self.layers), self.end, push, relay, heard, first, last, three,
                    to_right, to_left)  # fmt: skip


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
        phase: ``"reduce"`` (all-reduce over neighbour links), ``"push"``, ``"pull"`` or ``"gather"`` (exact mode);
            ``"scan"`` or ``"flood"`` (sweep mode).
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


def start_stages(
    layers: Sequence[Sequence[Layer]], capacity: float = math.inf, mode: str = EXACT
) -> list[DiffusionStage]:
    """One :class:`DiffusionStage` per stage of a split given by each stage's layers (the in-memory driver's)."""
    n_layers, firsts = sum(len(x) for x in layers), [0, *accumulate(len(x) for x in layers)]
    return [
        DiffusionStage(s, len(layers), firsts[s], own, n_layers=n_layers, capacity=capacity, mode=mode)
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
        yield DiffusionRound(index, phase, bound, tuple(stage.size for stage in stages))


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
    mode: str = EXACT,
) -> list[DiffusionStage]:
    values = as_values(costs, "costs")
    sizes = validate_partition(layers_per_stage, values.size)
    limits = as_capacities(memory, capacity, values.size, len(sizes))
    shared = shared_capacity(None if limits is None else limits[1].tolist())
    require_memory_fit(limits, values.size, len(sizes))
    layer_memory = None if limits is None else limits[0].tolist()
    return start_stages(stage_layers(values.tolist(), sizes, layer_memory), shared, mode)


def diffusion_rounds(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
    mode: str = EXACT,
) -> Iterator[DiffusionRound]:
    """Run the neighbour-only protocol round by round in one process (see the module docstring).

    Arguments are checked before the first round, when this function is called.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: starting split.
        memory: memory each layer needs, or ``None``.
        capacity: memory one stage may hold (a number, or a per-stage list whose entries are all equal).
        mode: ``"exact"`` or ``"sweep"`` (see :class:`DiffusionStage`).

    Returns:
        An iterator of :class:`DiffusionRound`, one per round; it ends when the protocol has finished (at once for
        a single stage).

    Raises:
        ValueError: on invalid arguments or capacities that differ between stages.
        InfeasibleMemoryError: if no split respects the capacity.

    """
    return drive(_stages(costs, layers_per_stage, memory, capacity, mode))


def diffuse(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    *,
    max_rounds: int | None = None,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
    mode: str = EXACT,
) -> DiffusionResult:
    """Re-balance a split by the decentralised neighbour-only diffusion protocol, simulated in one process.

    Guarantee (exact): the protocol always finishes, and it finishes on an optimal split - the bottleneck equals
    that of ``partition(costs, n, method="optimal")``, and the split is the same lexicographically largest one
    (exactly for integer-valued costs; for general floats up to rounding, since stages add their own layers
    left to right while the central planner uses prefix sums). The argument is in the module docstring; the
    rounds are bounded by :func:`round_bound`.

    With ``mode="sweep"`` (:mod:`~dynmo_lightning.balance.sweep`) the guarantee is instead: the bottleneck is below
    the optimal one plus the largest layer cost (``< S / P + c_max``), in :func:`~dynmo_lightning.balance.sweep.
    sweep_rounds` rounds (about ``2 P``); where that split breaks the memory capacity, the run goes on in exact mode.

    Intermediate rounds are planning state: a relayed request can leave a stage above the bound (or the capacity)
    for a few rounds. Only the final split is meant to be applied.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: starting split.
        max_rounds: stop after this many rounds (``None``: run to the end).
        memory: memory each layer needs, or ``None``.
        capacity: memory one stage may hold; the protocol needs one value shared by all stages.
        mode: ``"exact"`` (the optimal split) or ``"sweep"`` (within one layer's cost of it, far fewer rounds).

    Returns:
        The final split, the rounds used, its bottleneck, whether the protocol finished, the probes and card size.

    Raises:
        ValueError: on invalid arguments, a negative ``max_rounds``, or capacities that differ between stages.
        InfeasibleMemoryError: if no split respects the capacity.

    """
    if max_rounds is not None and (isinstance(max_rounds, bool) or operator.index(max_rounds) < 0):
        raise ValueError(f"max_rounds must be None or an integer >= 0, got {max_rounds!r}")
    stages = _stages(costs, layers_per_stage, memory, capacity, mode)
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
    width = 8 * stages[0].card_floats if len(stages) > 1 else 0
    return DiffusionResult(sizes, rounds, bottleneck(costs, sizes), converged, stages[0].probes, width)


def _lane(entry: tuple[float, ...] | None) -> tuple[tuple[float, ...], ...]:
    return () if entry is None else (entry,)


def _stages_of(pieces: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[int]:
    """The stage each piece (sorted, tiling the model) starts in under ``cuts``: one merge of two sorted lists."""
    stages, stage = [], 0
    for piece in pieces:
        while stage < len(cuts) and cuts[stage] <= piece[0]:
            stage += 1
        stages.append(stage)
    return stages
