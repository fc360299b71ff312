"""What one diffusion stage knows of itself and shows its neighbours, and the protocol each mode of it follows.

:class:`StageState` is the state both modes work on: the stage's own layers (always the model's ``[first, end)``),
their sums, the bound and phase of the round, and the :class:`~dynmo_lightning.balance.diffusion.cards.Card` it shows.
:class:`DiffusionMode` is what :class:`~dynmo_lightning.balance.diffusion.driver.DiffusionStage` dispatches to: the
exact mode (:mod:`~dynmo_lightning.balance.diffusion.exact_mode`) and the sweep mode
(:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) each plan as one generator of cards. :func:`shared_capacity` is
the one memory capacity the protocol takes.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable, Sequence
from typing import Protocol

from dynmo_lightning.balance.diffusion.cards import Card, Layer, Neighbours, StageOutcome


def fold(values: Iterable[float], start: float = 0.0) -> float:
    """Left-to-right float sum: a block's sum plus its next layer IS the longer block's sum, bit for bit.

    So the left neighbour's test "my load plus your first layer fits" equals the test on the block it will hold, and
    both neighbours decide it alike from the card. Rounded addition is monotone in both arguments, so a block's sum
    never falls when it grows at either end: the greedy argument holds for these sums as for exact ones.
    """
    total = start
    for x in values:
        total += x
    return total


class StageState:
    """One stage's view of the protocol: its own layers and what it shows on its card; every mode works on it.

    Attributes:
        stage: its index in the pipeline.
        n_stages: stages of the pipeline.
        n_layers: layers of the model.
        capacity: memory a stage may hold (the same for all stages).
        first: model index of its first layer (the exact mode moves it).
        layers: its layers, ``(cost, memory, *extras)`` each.
        width: numbers per layer.
        old: ``(first, end, sums)`` of the layers it held at the start.
        phase: phase of the round the next card is for (set by the mode before its first card).
        bound: the bottleneck bound it works against (``None`` before the exact search proposes one).
        rounds: rounds taken so far.
        probes: bounds the exact search probed.
        right_first: the first layer the right neighbour showed last round (``None`` before, or without one).
    """

    def __init__(
        self, stage: int, n_stages: int, first: int, layers: list[Layer], *, n_layers: int, capacity: float
    ) -> None:
        self.stage, self.n_stages, self.n_layers, self.capacity = stage, n_stages, n_layers, capacity
        self.first, self.layers, self.width = first, layers, len(layers[0])
        self.old = (first, first + len(layers), self.sums(layers))
        self.phase = ""
        self.bound: float | None = None
        self.rounds = self.probes = 0
        self.right_first: Layer | None = None
        self._held_key: tuple[int, int] | None = None
        self._held_sums = (0.0, 0.0)

    @property
    def end(self) -> int:
        """Model index after its last layer."""
        return self.first + len(self.layers)

    def load(self) -> float:
        """Sum of its layers' costs, added left to right (:func:`fold`)."""
        return self._held()[0]

    def memory(self) -> float:
        """Sum of its layers' memory, added left to right."""
        return self._held()[1]

    def _held(self) -> tuple[float, float]:
        """Load and memory of its layers, added up again only when they changed (a card is built every round).

        Its layers are always the model's ``[first, end)``, so that range names what it holds.
        """
        key = (self.first, len(self.layers))
        if self._held_key != key:
            self._held_key = key
            self._held_sums = (fold(x[0] for x in self.layers), fold(x[1] for x in self.layers))
        return self._held_sums

    @staticmethod
    def sums(layers: Sequence[Layer]) -> tuple[float, ...]:
        """Exact sums (``math.fsum``) of each layer number over ``layers``."""
        return tuple(math.fsum(column) for column in zip(*layers, strict=True))

    def make_card(self, *, push: bool = False, relay: bool = False, heard: int = 0,
                  values: tuple[float, ...] = (0.0, 0.0, 0.0), to_right: tuple[tuple[float, ...], ...] = (),
                  to_left: tuple[tuple[float, ...], ...] = ()) -> Card:  # fmt: skip
        """The card it shows this round: its own numbers, plus the phase's fields given here."""
        first, last, three = self.layers[0], self.layers[-1], (values[0], values[1], values[2])
        return Card(self.load(), self.memory(), len(self.layers), self.end, push, relay, heard, first, last, three,
                    to_right, to_left)  # fmt: skip


class DiffusionMode(Protocol):
    """One mode of the protocol as one stage runs it, on that stage's :class:`StageState`.

    Every stage of a run uses the same mode, so all of them take the same rounds and end in the same one.
    """

    #: Entries per card lane in this mode (the card's size is fixed for a run).
    slots: int

    def plan(self) -> Generator[Card, Neighbours, list[StageOutcome]]:
        """Yield this stage's card for each round, take in the neighbours' cards, return every stage's outcome."""
        ...


def shared_capacity(capacities: Sequence[float] | None) -> float:
    """The one memory capacity all stages share (``inf`` for none); the protocol cannot take per-stage ones.

    Args:
        capacities: each stage's capacity, or ``None``.

    Raises:
        ValueError: if the capacities differ between stages.
    """
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
