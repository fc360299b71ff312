"""The one-sweep mode of diffusion balancing: equal-share cuts from prefix sums, within one layer of the optimum.

Where the exact mode (:mod:`~dynmo_lightning.balance.diffusion`) searches the optimal bottleneck with about a dozen
probes of ``~3 P`` rounds each, the sweep mode plans in three short phases over the same neighbour cards:

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
   a raw stage empty the final cuts differ from the raw ones; then the stages cut their own ranges at the final
   cuts and flood those pieces once more. Per-stage sums (new, received, old) follow from the pieces: no stage
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

#: Pieces a card carries per direction in the flood phase (the card stays a few kB: latency-bound, not bandwidth).
SLOTS = 16


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
