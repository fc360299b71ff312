"""The one-sweep mode of diffusion balancing: equal-share cuts from prefix sums, within one layer of the optimum.

Where the exact mode (:mod:`~dynmo_lightning.balance.diffusion.exact_mode`) searches the optimal bottleneck with about a
dozen probes of ``~3 P`` rounds each, the sweep mode plans in three short phases over the same neighbour cards:

1. *scan*, ``P - 1`` rounds: a forward sweep passes each stage the cost of all layers before it (a prefix sum,
   added left to right) and a backward sweep the cost of all layers after it, concurrently; after ``P - 1`` rounds
   every stage knows its offset ``C(first)`` and the total ``S``. A card's lane carries one number each way.
2. *local cut*: each stage places each of its layers ``j`` (cost ``c_j``, cumulative start ``C(j)``) on the stage
   of its equal share, :func:`share`: ``h(j) = #{k in 1..P-1 : k S / P <= C(j) + c_j / 2}`` (the layer's midpoint;
   ``h`` never falls along the model). Runs of its layers with the same ``h`` are its *pieces*: ``(start, end,
   old stage, new stage, sums of every layer number)``, at most ``2 P - 1`` pieces over all stages.
3. *flood*, :func:`flood_rounds` rounds: the pieces travel the chain both ways, up to :data:`SLOTS` per card and
   direction, until every stage holds all of them. From them each stage derives the raw cuts ``r_k`` (the first
   layer with ``h >= k``; ``r_0 = 0``, ``r_P = L``) and the final cuts of :func:`final_cuts`. If huge layers left
   a raw stage empty the final cuts differ from the raw ones (and may go through a piece: layers of no cost share
   the next layer's share); then the stages cut their own ranges at the final cuts and flood those pieces once
   more. Per-stage sums (new, received, old) follow from the pieces: no stage
   ever sees a layer cost of another stage, only sums over runs of its layers.

Guarantee. Let ``B*`` be the optimal bottleneck and ``c_max`` the largest layer cost. The sweep's bottleneck is
``< S / P + c_max <= B* + c_max`` (and ``<= 2 B*``): within one layer's cost of the optimum. Proof:

* A raw stage ``k`` holds the layers whose midpoints lie in ``[k S / P, (k + 1) S / P)``. Its first layer ``a``
  starts at ``C(a) >= k S / P - c_a / 2``, its last layer ``b`` ends at ``C(b) + c_b < (k + 1) S / P + c_b / 2``,
  so its load and that of any block inside it is ``< S / P + (c_a + c_b) / 2 <= S / P + c_max``.
* Raw stages may be empty (a layer above ``S / P``) or leave too few layers for the stages after them. The final
  cuts are ``J_k = min(A_k, L - P + k)`` with ``A_k = k + max_{0 <= m <= k} (r_m - m)`` (``J_0 = 0``,
  ``J_P = L``). Both terms rise strictly with ``k``, ``J_1 >= 1`` and ``J_{P-1} <= L - 1``: every stage holds
  at least one layer. Each final stage ``[J_s, J_{s+1})`` is one layer (load ``<= c_max <= B*``) or lies inside
  raw stage ``s = [r_s, r_{s+1})``: (i) if ``J_{s+1} > r_{s+1}``, then ``A_{s+1} = A_s + 1`` (the max is reached
  at some ``m <= s``), and either ``J_s = A_s``, so ``J_{s+1} <= J_s + 1``, or ``J_s = L - P + s < A_s``, so
  ``J_{s+1} = L - P + s + 1``: one layer either way; (ii) if ``J_s < r_s``, then ``J_s = L - P + s`` (as
  ``A_s >= r_s``), so ``J_{s+1} = J_s + 1``: one layer.
* ``B* >= S / P`` (some stage carries the average) and ``B* >= c_max`` (some stage holds the largest layer).

With float costs the bound holds up to the rounding of the sums (exactly for integer-valued costs). Memory is not
part of the cut: when the sweep's split breaks the shared capacity, the stages (who all see it in the per-stage
sums) fall back to the exact mode, which meets the capacity whenever any split does.

Rounds: :func:`sweep_rounds` - ``(P - 1) + F`` rounds, plus ``F`` when huge layers moved a cut, where
``F = P - 2 + ceil((2 P - 1) / SLOTS)``.

:class:`SweepMode` is this mode as one stage runs it, on the stage's
:class:`~dynmo_lightning.balance.diffusion.stage_state.StageState`; the functions before it are the cut's arithmetic,
which :func:`sweep_split` also computes in one place.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Generator, Sequence
from itertools import pairwise

import numpy as np

from dynmo_lightning.balance.diffusion.cards import Card, Layer, Neighbours, StageOutcome
from dynmo_lightning.balance.diffusion.exact_mode import ExactMode
from dynmo_lightning.balance.diffusion.stage_state import StageState, fold

#: Pieces a card carries per direction in the flood phase (the card stays a few kB: latency-bound, not bandwidth).
SLOTS = 16

#: Phases of the sweep mode, as :attr:`~dynmo_lightning.balance.diffusion.stage_state.StageState.phase` names them.
SCAN, FLOOD = "scan", "flood"


def share(mid: float, total: float, n_stages: int) -> int:
    """The equal share a point of the cumulative cost falls in: ``#{k in 1..P-1 : k * total / P <= mid}``.

    Compared as ``k * total <= P * mid``, exact for integer-valued costs.
    """
    if not total > 0:
        return 0
    k = min(n_stages - 1, max(0, int(mid * n_stages / total)))
    while k < n_stages - 1 and (k + 1) * total <= mid * n_stages:
        k += 1
    while k > 0 and k * total > mid * n_stages:
        k -= 1
    return k


def final_cuts(raw: Sequence[int], n_layers: int) -> list[int]:
    """Cuts ``J_1 .. J_{P-1}`` from raw cuts ``r_1 .. r_{P-1}``: every stage gets a layer (see the module docstring).

    ``J_k = min(k + max_{0 <= m <= k} (r_m - m), L - P + k)`` with ``r_0 = 0``: a cut that an earlier one pushed
    right moves one layer per stage, and no cut leaves fewer layers than stages after it.
    """
    n_stages, cuts, most = len(raw) + 1, [], 0
    for k, r in enumerate(raw, 1):
        most = max(most, r - k)
        cuts.append(min(k + most, n_layers - n_stages + k))
    return cuts


def raw_cuts(pieces: Sequence[Sequence[float]], n_stages: int, n_layers: int) -> list[int]:
    """``r_k``, the first layer placed on stage ``k`` or later, from pieces ``(start, end, old, new, ...)``."""
    first = [n_layers] * (n_stages + 1)
    for piece in pieces:
        first[int(piece[3])] = min(first[int(piece[3])], int(piece[0]))
    for k in range(n_stages - 1, 0, -1):
        first[k] = min(first[k], first[k + 1])
    return first[1:n_stages]


def sizes_of(cuts: Sequence[int], n_layers: int) -> list[int]:
    """Layers per stage of cuts ``J_1 .. J_{P-1}``."""
    return [b - a for a, b in pairwise([0, *cuts, n_layers])]


def sweep_split(costs: Sequence[float], n_stages: int) -> list[int]:
    """The sweep mode's split computed in one place (the centralised form of the same cut; a test reference).

    Adds costs left to right like the stages do, so for integer-valued costs it is exactly the protocol's split.
    """
    total, mids = 0.0, []
    for c in costs:
        mids.append(total + c / 2)
        total += c
    pieces = [(j, j + 1, 0, share(mid, total, n_stages)) for j, mid in enumerate(mids)]
    return sizes_of(final_cuts(raw_cuts(pieces, n_stages, len(costs)), len(costs)), len(costs))


def flood_rounds(n_stages: int) -> int:
    """Rounds after which every stage holds all ``<= 2 P - 1`` pieces: ``P - 2 + ceil((2 P - 1) / SLOTS)``.

    Why: every link forwards up to ``SLOTS`` pieces per round whenever it has any (work-conserving). By induction
    over the links, the link out of stage ``j`` has sent ``min(N_j, SLOTS (t - j))`` pieces by round ``t``, where
    ``N_j`` counts the pieces of stages ``<= j``; so all pieces from the left have reached stage ``P - 1`` by round
    ``P - 2 + ceil(N / SLOTS)``, and every other stage earlier (likewise to the left).
    """
    return n_stages - 2 + math.ceil((2 * n_stages - 1) / SLOTS) if n_stages > 1 else 0


def sweep_rounds(n_stages: int, *, moved: bool) -> int:
    """Rounds of a sweep-mode run: scan plus one flood, plus a second flood when huge layers ``moved`` a cut."""
    if n_stages < 2:
        return 0
    return n_stages - 1 + (2 if moved else 1) * flood_rounds(n_stages)


class SweepMode:
    """The sweep mode as one stage runs it: scan, local cut, flood (twice if a cut moved); see the module docstring.

    Where the split breaks the shared memory capacity, every stage sees it in the per-stage sums and goes on in the
    exact mode (:class:`~dynmo_lightning.balance.diffusion.exact_mode.ExactMode`) alike.

    Args:
        state: the stage's state; the mode sets its phase (it moves no layer records while it plans).
    """

    #: Pieces per card lane in the flood.
    slots = SLOTS

    def __init__(self, state: StageState) -> None:
        self.state = state

    def plan(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Sweep (with two or more stages); return its outcome if it fits the capacity, else plan in exact mode."""
        s = self.state
        if s.n_stages > 1:
            outcome = yield from self._sweep()
            if all(o.new[1] <= s.capacity for o in outcome):
                return outcome
            # The equal-share cut ignores memory: every stage sees the breach in the sums and falls back alike.
        return (yield from ExactMode(s).plan())

    def _sweep(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Scan, local cut, flood (twice if a cut moved)."""
        s = self.state
        costs, p = [layer[0] for layer in s.layers], s.n_stages
        offset, total = yield from self._scan(costs)
        raw, at = [], offset  # runs of its layers with the same equal share: (share, first index, layers)
        for index, layer in enumerate(s.layers, s.first):
            h = share(at + layer[0] / 2, total, p)
            at += layer[0]
            if raw and raw[-1][0] == h:
                raw[-1][2].append(layer)
            else:
                raw.append((h, index, [layer]))
        pieces = yield from self._flood([self._piece(start, run, h) for h, start, run in raw])
        cuts = final_cuts(raw_cuts(pieces, p, s.n_layers), s.n_layers)
        if _moved_off(pieces, cuts):
            # Huge layers moved a cut off its equal share: cut its own layers at the final cuts and flood again.
            bounds = sorted({s.first, s.end, *(c for c in cuts if s.first < c < s.end)})
            own = [self._piece(a, s.layers[a - s.first : b - s.first], bisect_right(cuts, a))
                   for a, b in pairwise(bounds)]  # fmt: skip
            pieces = yield from self._flood(own)
        return self._tally(pieces, cuts)

    def _scan(self, costs: list[float]) -> Generator[Card, Neighbours, tuple[float, float]]:
        """``P - 1`` rounds: prefix sums flow right, suffix sums left; returns ``(C(first), S)``."""
        s = self.state
        s.phase = SCAN
        last = s.n_stages - 1
        offset, after = (0.0 if s.stage == 0 else None), (0.0 if s.stage == last else None)
        out_right = ((0.0, fold(costs)),) if offset is not None else ()
        out_left = ((0.0, fold(costs) + after),) if after is not None else ()
        for _ in range(last):
            left, right = yield s.make_card(to_right=out_right, to_left=out_left)
            if offset is None and left is not None and left.to_right:
                offset = left.to_right[0][1]
                out_right = ((0.0, fold(costs, offset)),)
            if after is None and right is not None and right.to_left:
                after = right.to_left[0][1]
                out_left = ((0.0, fold(costs) + after),)
        assert offset is not None and after is not None, "the scan reaches every stage within P - 1 rounds"
        return offset, fold(costs, offset) + after

    def _piece(self, start: int, run: Sequence[Layer], new: int) -> tuple[float, ...]:
        """A run of its layers: ``(start, end, old stage, new stage, *sums)``."""
        return (float(start), float(start + len(run)), float(self.state.stage), float(new), *self.state.sums(run))

    def _flood(self, mine: list[tuple[float, ...]]) -> Generator[Card, Neighbours, list[tuple[float, ...]]]:
        """Pass pieces along the chain both ways, :data:`SLOTS` per card and way, until every stage has all."""
        s = self.state
        s.phase = FLOOD
        keep = 4 + s.width  # a decoded entry is padded to the gather's width
        table = {int(piece[0]): piece for piece in mine}
        # What is still to forward each way (own pieces, then what arrives from the other side), and how far sent.
        queues, sent = (list(mine), list(mine)), [0, 0]
        ends = (s.stage == s.n_stages - 1, s.stage == 0)
        for _ in range(flood_rounds(s.n_stages)):
            lanes = []
            for way, (queue, end) in enumerate(zip(queues, ends, strict=True)):
                lanes.append(() if end else tuple(queue[sent[way] : sent[way] + self.slots]))
                sent[way] += len(lanes[-1])
            left, right = yield s.make_card(to_right=lanes[0], to_left=lanes[1])
            arrived = (left.to_right if left else (), right.to_left if right else ())
            for lane, queue in zip(arrived, queues, strict=True):
                for entry in lane:
                    piece = entry if len(entry) == keep else entry[:keep]
                    table[int(piece[0])] = piece
                    queue.append(piece)
        pieces = [table[k] for k in sorted(table)]
        if [int(x[0]) for x in pieces[1:]] != [int(x[1]) for x in pieces[:-1]] or pieces[-1][1] != s.n_layers:
            raise RuntimeError(f"diffusion stage {s.stage}: the flood left a gap in the pieces of the model")
        return pieces

    def _tally(self, pieces: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[StageOutcome]:
        """Every stage's outcome from the pieces (each tagged with its old and new stage) and the final cuts."""
        n_stages, n_layers = self.state.n_stages, self.state.n_layers
        table = np.asarray(pieces, dtype=np.float64)
        was, now, sums = table[:, 2].astype(np.int64), table[:, 3].astype(np.int64), table[:, 4:]
        moved = (was != now).astype(np.float64)

        def per_stage(stage: np.ndarray, weight: np.ndarray | float = 1.0) -> list[list[float]]:
            columns = [np.bincount(stage, weights=column * weight, minlength=n_stages) for column in sums.T]
            return np.stack(columns, axis=1).tolist()

        new, received, old = per_stage(now), per_stage(now, moved), per_stage(was)
        sizes = sizes_of(cuts, n_layers)
        return [StageOutcome(sizes[s], tuple(new[s]), tuple(received[s]), tuple(old[s])) for s in range(n_stages)]


def _moved_off(pieces: Sequence[Sequence[float]], cuts: Sequence[int]) -> bool:
    """Whether the final ``cuts`` put a piece on another stage than its equal share, or cut through one.

    A cut inside a piece (layers of no cost share a midpoint with the layer after them) moves its tail to the next
    stage while its start stays: the piece's sums would be counted on one stage.
    """
    if _stages_of(pieces, cuts) != [int(piece[3]) for piece in pieces]:
        return True
    return any(piece[0] < cut < piece[1] for piece in pieces for cut in cuts)


def _stages_of(pieces: Sequence[Sequence[float]], cuts: Sequence[int]) -> list[int]:
    """The stage each piece (sorted, tiling the model) starts in under ``cuts``: one merge of two sorted lists."""
    stages, stage = [], 0
    for piece in pieces:
        while stage < len(cuts) and cuts[stage] <= piece[0]:
            stage += 1
        stages.append(stage)
    return stages
