"""The messages of diffusion balancing: the card neighbours exchange every round and the outcome all stages learn.

Both modes of the protocol (:mod:`~dynmo_lightning.balance.diffusion.exact_mode`,
:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) speak with the same :class:`Card`, fixed in size for a run so that
it travels as one float64 tensor, and end on the same :class:`StageOutcome` table, which every stage holds and the
runtime checks with :func:`require_outcome_fits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from dynmo_lightning.balance.split.fit import InfeasibleMemoryError

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


#: The cards a stage receives in a round, from its left and right neighbour (``None`` where there is none).
Neighbours = tuple[Card | None, Card | None]


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

    Args:
        outcome: every stage's :class:`StageOutcome`, in pipeline order.
        capacity: memory one stage may hold (``None``: no limit).

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
