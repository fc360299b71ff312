"""Decentralised diffusion balancing: stages exchange boundary layers with their pipeline neighbours only.

One protocol, two drivers. :class:`DiffusionStage` is the state machine of ONE pipeline stage: it knows its own
layers (cost, memory and any extra numbers that ride along, e.g. forward/backward time and bytes) and, every round,
emits one fixed-size :class:`Card` to both neighbours and consumes the two cards they sent. :func:`diffuse` and
:func:`diffusion_rounds` drive all stages in one process with in-memory message passing (planning, the simulator,
tests); :func:`dynmo_lightning.pipeline.stage.neighbours.run_stage` drives one stage per process with point-to-point
messages on the pipeline group (the balancer at runtime). Both run the same code, so they take the same rounds and
end on the same split.

Two modes, one room each; :class:`DiffusionStage` dispatches to its mode's object (a
:class:`~dynmo_lightning.balance.diffusion.stage_state.DiffusionMode`) and never branches on the mode:

* ``"exact"`` (:mod:`~dynmo_lightning.balance.diffusion.exact_mode`) ends on the optimal split, in about a dozen probes
  of ``~3 P`` rounds each: a bound search by push and pull settles, then a gather; its proof and round bound
  (:func:`round_bound`, :func:`probe_bound`) are there.
* ``"sweep"`` (:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) scans prefix sums once, cuts at equal shares
  locally and floods the resulting pieces: about ``2 P`` rounds, bottleneck below the optimum plus the largest layer
  cost (and exact mode where that split breaks the memory capacity).

Both use the same cards and outcome (:mod:`~dynmo_lightning.balance.diffusion.cards`: :class:`Card`,
:class:`StageOutcome`, :func:`require_outcome_fits`), the same stage state
(:mod:`~dynmo_lightning.balance.diffusion.stage_state`, with :func:`shared_capacity`) and the drivers here; those names
are re-exported from this module, where callers import them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from dynmo_lightning.balance.diffusion.cards import (
    Card,
    Layer,
    Neighbours,
    StageOutcome,
    card_width,
    require_outcome_fits,
)
from dynmo_lightning.balance.diffusion.exact_mode import GATHER, PULL, PUSH, REDUCE, ExactMode, probe_bound, round_bound
from dynmo_lightning.balance.diffusion.stage_state import DiffusionMode, StageState, shared_capacity
from dynmo_lightning.balance.diffusion.sweep_mode import FLOOD, SCAN, SweepMode
from dynmo_lightning.balance.split.checks import as_capacities, as_values
from dynmo_lightning.balance.split.fit import require_memory_fit
from dynmo_lightning.balance.split.loads import bottleneck, validate_partition

__all__ = [
    "EXACT",
    "FLOOD",
    "GATHER",
    "MODES",
    "PULL",
    "PUSH",
    "REDUCE",
    "SCAN",
    "SWEEP",
    "Card",
    "DiffusionResult",
    "DiffusionRound",
    "DiffusionStage",
    "Layer",
    "Neighbours",
    "StageOutcome",
    "card_width",
    "diffuse",
    "diffusion_rounds",
    "drive",
    "probe_bound",
    "require_outcome_fits",
    "round_bound",
    "shared_capacity",
    "stage_layers",
    "start_stages",
]

#: Modes of the protocol: ``"exact"`` ends on the optimal split; ``"sweep"``
#: (:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) ends within one layer's cost of it in ``~2 P`` rounds.
MODES = EXACT, SWEEP = ("exact", "sweep")

#: The object each mode's stage runs, by mode name.
_MODE_OF: dict[str, Callable[[StageState], DiffusionMode]] = {EXACT: ExactMode, SWEEP: SweepMode}


class DiffusionStage(StageState):
    """The protocol as ONE pipeline stage runs it: a state machine that emits a card and consumes its neighbours'.

    Drive it round by round: send :attr:`card` to both neighbours, then call :meth:`step` with the cards the left
    and right neighbour sent in the same round (``None`` where there is no neighbour). When :attr:`card` is
    ``None`` the stage is done: :attr:`outcome` holds every stage's :class:`StageOutcome` (all stages finish in the
    same round). The stage never sees another stage's layers but the first/last one a neighbour shows on its card.
    Its state is a :class:`~dynmo_lightning.balance.diffusion.stage_state.StageState`; its rounds are its mode's plan.

    Args:
        stage: its index in the pipeline.
        n_stages: stages of the pipeline.
        first: model index of its first layer.
        layers: its layers, ``(cost, memory, *extras)`` each, all of the same length (at least 2).
        n_layers: layers of the model.
        capacity: memory a stage may hold (the same for all stages).
        mode: ``"exact"`` (the bound search of :mod:`~dynmo_lightning.balance.diffusion.exact_mode`: the optimal split)
            or ``"sweep"`` (equal-share cuts from prefix sums, within one layer's cost of the optimum in about ``2 P``
            rounds; see :mod:`~dynmo_lightning.balance.diffusion.sweep_mode`). Every stage of a run must use the same
            mode.
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
        super().__init__(stage, n_stages, first, records, n_layers=n_layers, capacity=capacity)
        self.mode, self._planner = mode, _MODE_OF[mode](self)
        #: Entries per card lane: one in exact mode, :data:`~dynmo_lightning.balance.diffusion.sweep_mode.SLOTS` in
        #: sweep mode.
        self.slots = self._planner.slots
        self.outcome: list[StageOutcome] | None = None
        self._program = self._run()
        self.card: Card | None = next(self._program, None)

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
            self.right_first = right.first
        try:
            self.card = self._program.send((left, right))
        except StopIteration:
            self.card = None

    def _run(self) -> Generator[Card, Neighbours, None]:
        self.outcome = yield from self._planner.plan()


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
    """Run the neighbour-only protocol round by round in one process (see :class:`DiffusionStage`).

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
    left to right while the central planner uses prefix sums). The argument is in :mod:`~dynmo_lightning.balance.
    exact`'s docstring; the rounds are bounded by :func:`round_bound`.

    With ``mode="sweep"`` (:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`) the guarantee is instead: the
    bottleneck is below the optimal one plus the largest layer cost (``< S / P + c_max``), in
    :func:`~dynmo_lightning.balance.diffusion.sweep_mode. sweep_rounds` rounds (about ``2 P``); where that split breaks
    the memory capacity, the run goes on in exact mode.

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
