"""The exact mode of diffusion balancing: a bound search by push and pull settles, ending on the optimal split.

The exact protocol runs in synchronous rounds. In round ``r`` only the boundaries ``p`` (between stages ``p`` and
``p + 1``) with ``p % 2 == r % 2`` may move, one layer at a time, so no stage gains or loses layers on both sides at
once and no layer skips a stage. A card carries what the neighbour needs to take the same decision on the boundary
the two share: the stage's load and memory, its layer count and end, its first and last layer (so a moved layer's
numbers travel with it), a push flag, a relay flag, the latest round it heard of activity, three reduction values
and a lane of entries each way (one gather entry in exact mode; prefix sums and pieces in sweep mode).

Besides layers, the stages diffuse a bottleneck bound ``B``: every stage runs its own copy of the exact search of
:class:`~dynmo_lightning.balance.split.bound_search.BoundSearch`, fed with values all-reduced over neighbour links (each
round a stage combines its value with its neighbours'; after ``P - 1`` rounds all agree: max, min and "and" are
idempotent), so all copies propose the same bound. For a bound ``B`` (never below the largest layer cost) the stages
*settle*:

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

:class:`ExactMode` is this mode as one stage runs it, on the stage's
:class:`~dynmo_lightning.balance.diffusion.stage_state.StageState`; the sweep mode
(:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) goes on in it when its own split breaks the memory capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

from dynmo_lightning.balance.diffusion.cards import Card, Layer, Neighbours, StageOutcome
from dynmo_lightning.balance.diffusion.stage_state import StageState
from dynmo_lightning.balance.split.bound_search import BoundSearch

#: Phases of the exact mode, as :attr:`~dynmo_lightning.balance.diffusion.stage_state.StageState.phase` names them.
REDUCE, PUSH, PULL, GATHER = "reduce", "push", "pull", "gather"

_Op = Callable[[float, float], float]


class ExactMode:
    """The exact mode as one stage runs it: probes of settles and reductions, then the gather (module docstring).

    Args:
        state: the stage's state; the mode moves its layers and sets its phase, bound and probes.
    """

    #: One entry per card lane: the gather forwards one entry each way.
    slots = 1

    def __init__(self, state: StageState) -> None:
        self.state = state

    def plan(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Search and settle on the optimal split (with two or more stages), then gather every stage's outcome."""
        if self.state.n_stages > 1:
            yield from self._search()
        return (yield from self._gather())

    def _search(self) -> Generator[Card, Neighbours, None]:
        """The bound search: probes of settles and reductions until the split is the optimal one."""
        s = self.state
        largest = max(layer[0] for layer in s.layers)
        largest, current, _ = yield from self._allreduce((largest, s.load(), 0.0), (max, max, max))
        # The largest layer is a lower bound; the current bottleneck a feasible first guess.
        search, feasible = BoundSearch(largest, (current,)), False
        # Every stage's copy of the search sees the same all-reduced values: all propose the same bounds.
        while not search.done:
            s.bound, s.probes = search.point(), s.probes + 1
            yield from self._settle()
            worst, grown, fits = yield from self._allreduce(self._report(), (max, min, min))
            feasible = bool(fits)
            search.record(feasible, worst if feasible else grown)
        # A feasible last probe left T(bound) = T(its bottleneck) = T(optimum); otherwise settle there.
        if not feasible:
            s.bound = search.hi
            yield from self._settle()

    def _settle(self) -> Generator[Card, Neighbours, None]:
        yield from self._phase(PUSH)
        yield from self._phase(PULL)

    def _allreduce(self, value: tuple[float, ...], ops: tuple[_Op, ...]) -> Generator[Card, Neighbours, tuple]:
        """Combine with both neighbours' values every round; after ``P - 1`` rounds every stage holds the result."""
        s = self.state
        s.phase = REDUCE
        for _ in range(s.n_stages - 1):
            left, right = yield s.make_card(values=value)
            lv, rv = (left.values if left else value), (right.values if right else value)
            value = tuple(op(op(a, b), c) for op, a, b, c in zip(ops, lv, value, rv, strict=True))
        return value

    def _phase(self, kind: str) -> Generator[Card, Neighbours, None]:
        """One push or pull phase, until the stage detects (with all others, in the same round) that it is over."""
        s = self.state
        s.phase = kind
        heard, asked = s.rounds, None  # latest activity heard of; the layer the left neighbour asked for
        while True:
            now = s.rounds + 1
            turn = now % 2
            if kind == PUSH:
                active, left, right = yield from self._push_round(turn, heard)
            else:
                active, left, right, asked = yield from self._pull_round(turn, heard, asked)
            news = [now if active else heard, *(c.heard for c in (left, right) if c is not None)]
            heard = max(news)
            if heard < now - (s.n_stages - 1):
                return

    def _push_round(self, turn: int, heard: int) -> Generator[Card, Neighbours, tuple[bool, Card | None, Card | None]]:
        """One round of the push phase: pass the last layer right when over the bound, take the left one's.

        Args:
            turn: the parity of the boundaries that may move this round.
            heard: the latest round with activity this stage heard of.

        Returns:
            Whether this stage was active (wanted to push), and the cards of its left and right neighbours.
        """
        s = self.state
        active = s.stage < s.n_stages - 1 and not self._fits()
        left, right = yield s.make_card(push=active, heard=heard)
        # Both sides of a boundary move the layer in the same round: only on the boundary's turn.
        if active and s.stage % 2 == turn:
            s.layers.pop()
        if left is not None and left.push and (s.stage - 1) % 2 == turn:
            s.layers.insert(0, left.last)
            s.first -= 1
        return active, left, right

    def _pull_round(
        self, turn: int, heard: int, asked: int | None
    ) -> Generator[Card, Neighbours, tuple[bool, Card | None, Card | None, int | None]]:
        """One round of the pull phase: ask for the right neighbour's first layer, grant the left one's request.

        Args:
            turn: the parity of the boundaries that may move this round.
            heard: the latest round with activity this stage heard of.
            asked: the index of the layer the left neighbour asked for last round (``None``: none).

        Returns:
            Whether this stage was active (asked for a layer), the cards of its left and right neighbours, and the
            index of the layer the left neighbour asked for this round (``None``: none).
        """
        s = self.state
        # A one-layer stage whose only layer is asked for relays the request to its right neighbour.
        mine = s.make_card(relay=len(s.layers) == 1 and asked == s.first, heard=heard)
        left, right = yield mine
        active = right is not None and self._wants(mine, s.stage, right.first)
        by_left = left is not None and self._wants(left, s.stage - 1, mine.first)
        asked = left.end if left is not None and by_left else None
        if right is not None and active and s.stage % 2 == turn and right.size >= 2:
            s.layers.append(right.first)
        if by_left and (s.stage - 1) % 2 == turn and mine.size >= 2:
            s.layers.pop(0)
            s.first += 1
        return active, left, right, asked

    def _gather(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Pipeline one entry per stage along the chain both ways: ``P - 1`` rounds, one entry per card and way."""
        s = self.state
        s.phase = GATHER
        table = {s.stage: self._entry()}
        for k in range(1, s.n_stages):
            lanes = (table.get(s.stage - k + 1), table.get(s.stage + k - 1))
            left, right = yield s.make_card(to_right=_lane(lanes[0]), to_left=_lane(lanes[1]))
            for entry in (*(left.to_right if left else ()), *(right.to_left if right else ())):
                table[int(entry[0])] = entry
        return [StageOutcome.from_entry(table[i], s.width) for i in range(s.n_stages)]

    def _entry(self) -> tuple[float, ...]:
        """Its gather entry: ``(stage, size, *new, *received, *old)`` sums."""
        s = self.state
        start, stop, old = s.old
        got = [layer for i, layer in enumerate(s.layers, s.first) if not start <= i < stop]
        nothing = (0.0,) * s.width
        received = s.sums(got) if got else nothing
        return (float(s.stage), float(len(s.layers)), *s.sums(s.layers), *received, *old)

    def _fits(self) -> bool:
        s = self.state
        assert s.bound is not None
        return s.load() <= s.bound and s.memory() <= s.capacity

    def _wants(self, card: Card, stage: int, nxt: Layer) -> bool:
        """Whether ``stage`` (showing ``card``) asks for the next layer ``nxt``: both neighbours decide it alike."""
        s = self.state
        assert s.bound is not None
        if card.end >= s.n_layers - (s.n_stages - 1 - stage):
            return False  # every later stage still needs one layer
        if card.relay:
            return True  # relay: its only layer goes left, so it takes one from the right first
        return card.load + nxt[0] <= s.bound and card.memory + nxt[1] <= s.capacity

    def _report(self) -> tuple[float, float, float]:
        """This stage's share of a probe's outcome: load, least bound that would change its state, fits.

        A stage the bound stopped changes once the bound admits its next layer; the last stage, which holds what
        is left, once the bound admits its whole load. Memory-stopped stages never change with the bound.
        """
        s = self.state
        load, memory = s.load(), s.memory()
        if s.stage == s.n_stages - 1:
            change = load if memory <= s.capacity else math.inf
        else:
            assert s.right_first is not None
            nxt = s.right_first
            change = load + nxt[0] if memory + nxt[1] <= s.capacity else math.inf
        return load, change, float(self._fits())


def _lane(entry: tuple[float, ...] | None) -> tuple[tuple[float, ...], ...]:
    return () if entry is None else (entry,)


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

    Args:
        n_layers: layers of the model.
        n_stages: stages of the pipeline.
        probes: bounds the search probed (``K``).
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

    Args:
        current: the starting split's bottleneck (the first probe).
        largest: the largest layer cost (a lower bound).
        gap: the least difference between two distinct block sums (1 for integer costs).
    """
    spread = max(current - largest, 0.0) / gap
    return 2 + (math.ceil(math.log2(spread)) if spread > 1 else 0)
