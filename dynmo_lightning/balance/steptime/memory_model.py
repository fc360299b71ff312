"""Every stage's peak memory under the schedule's own task order, and what a migration holds on the way.

A layer is described by :class:`LayerBytes` (its weights and optimizer state as one process holds them, ``1/D``
under FSDP2; the gradients and weight copies a step holds, which under FSDP2's ``fsdp_memory="fast"`` are the whole
layer's, gathered and in the reduction dtype, and under ``"lean"`` a shard, with one layer's whole weights and
gradient held only while it runs; what it keeps for backward per micro-batch, a checkpointed layer its kept input;
its recomputation's bytes; its input's size). A rank's memory during one step is then, in the order its schedule
runs its tasks (:func:`~dynmo_lightning.balance.steptime.makespan.rank_orders`):

- always: the weights and optimizer state of its stages, and torch's receive buffers, one input per micro-batch on
  every stage but the first and one output gradient per micro-batch on every stage but the last;
- from each stage's first backward (its weight part, under the zero-bubble schedules) on: that stage's gradients;
- per micro-batch a stage has run forward for and not yet finished the backward of: what its layers keep for
  backward, and the stage's output (held for the backward; the last stage's is the loss);
- during a backward: the input gradient it makes and, where layers are checkpointed, the largest recomputation;
  in every backward of a stage but the step's first, also the gradients of the weight copies autocast cached in
  that first forward, which wait for the end of the pass (autograd runs a node in reverse order of creation).

Under the split backward (``I`` then ``W``) a micro-batch's activations are held until its weight part: the input
part keeps what the weight gradients need. The peak is the largest of these sums over the task order. Which
micro-batches are in flight depends on the order only, not on the layers, so :class:`MemoryModel` works out every
rank's states once and then prices any split in ``O(states)``: under 1F1B stage ``s`` holds ``min(M, P - s)``
micro-batches, under GPipe ``M``, under ZBV and DualPipeV what their orders say (``tests/balance/test_memory.py``;
``docs/memory.md`` compares the model with torch's ``MemTracker`` at 1B and 7B sizes).

Pure Python: no torch, as everything in ``balance/``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import rank_orders


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """What one layer takes on the process that holds it, in bytes.

    Attributes:
        params: its weights (and buffers) as this process holds them (a shard under FSDP2).
        grads: its weights' gradients as a step holds them from the stage's first backward on (FSDP2: the whole
            layer's in the reduction dtype under ``fsdp_memory="fast"``, a shard under ``"lean"``).
        optim: its optimizer state (AdamW: two moments, twice ``grads``; SGD with momentum: once).
        activations: what it keeps for backward per micro-batch (checkpointed: its kept input only).
        recompute: checkpointed, what its recomputation holds during its backward (0 otherwise).
        inputs: its input activation of one micro-batch (a stage starting here receives it).
        workspace: what its backward holds at its peak besides the activations and the weights' gradients
            and a checkpointed layer's recomputation is part of it (``None``: ``inputs + recompute``).
        workspace_again: what its backward holds at its peak besides the activations when its gradients exist
            already and it adds to them (every backward of a step but its stage's first): its new gradients until
            they are added, and its casts' gradients (:attr:`cast_grads`) among them (``None``: :attr:`workspace`
            and :attr:`cast_grads`).
        workspace_input: what a split backward's input part (gradients of the activations, none of the weights)
            holds at its peak besides the activations (``None``: as :attr:`workspace`).
        outputs: its output of one micro-batch, read for the model's last layer only: torch's stage keeps its
            output until its backward is done, the last stage's beside the loss (the others' is the next layer's
            :attr:`inputs`).
        split_extra: under the split backward, what a micro-batch holds between the input and the weight part
            beyond its activations (the output gradients kept for the weight part, less what the input part freed).
        copies: copies of its weights held during a step, once for all micro-batches (autocast's bf16 casts,
            FSDP2's gathered weights, which ``fsdp_memory="fast"`` keeps for the step).
        gathered: what it holds only while it runs, on top of :attr:`workspace` (``fsdp_memory="lean"``: its
            weights gathered for its backward, and its whole gradient until the reduce-scatter).
        cast_grads: the gradients of its weight copies made by a cast the step keeps (autocast's): in a backward
            over its stage after the step's first, held from its own backward to the end of that pass. A cast made
            in the step's first forward is an older autograd node than everything a later micro-batch's forward
            made, and autograd runs the newest first, so the cast's backward (to the weights' dtype, added to their
            gradients) waits until the pass has done all the rest (0: no such copies, e.g. FSDP2's gathered
            weights, which are parameters whose gradients are taken at once).
    """

    params: float
    grads: float
    optim: float
    activations: float
    recompute: float = 0.0
    inputs: float = 0.0
    workspace: float | None = None
    split_extra: float = 0.0
    copies: float = 0.0
    gathered: float = 0.0
    cast_grads: float = 0.0
    workspace_again: float | None = None
    workspace_input: float | None = None
    outputs: float = 0.0

    @property
    def backward(self) -> float:
        """The backward's transient: :attr:`workspace` (or its input gradient and recomputation), :attr:`gathered`."""
        return (self.inputs + self.recompute if self.workspace is None else self.workspace) + self.gathered

    @property
    def backward_again(self) -> float:
        """The transient of a backward adding to existing gradients: :attr:`workspace_again`, :attr:`gathered`."""
        if self.workspace_again is None:
            return self.backward + self.cast_grads
        return self.workspace_again + self.gathered

    @property
    def backward_input(self) -> float:
        """The transient of a split backward's input part: :attr:`workspace_input` (or as :attr:`backward`)."""
        return self.backward if self.workspace_input is None else self.workspace_input + self.gathered

    @property
    def static(self) -> float:
        """Weights and optimizer state: held all the time."""
        return self.params + self.optim


@dataclasses.dataclass(frozen=True)
class _State:
    """A rank between or during two tasks (see :func:`_rank_states`)."""

    alive: tuple[int, ...]
    pending: tuple[int, ...]
    grads: tuple[bool, ...]
    backward: int = -1
    fresh: bool = False
    input_part: bool = False

    def transient(self, part: dict[str, float]) -> float:
        """The backward's transient of the stage whose :meth:`MemoryModel.stage_parts` is ``part`` (none: 0)."""
        if self.backward < 0:
            return 0.0
        return part["fresh" if self.fresh else "input" if self.input_part else "again"]


def _rank_states(order: Sequence[tuple[str, int, int]], local: list[int]) -> list[_State]:
    """Every state a rank's task order passes through.

    Per local stage: micro-batches in flight (``pending`` of them between their input and weight parts) and whether
    its gradients exist; during a backward, whose (``backward``, a local index), whether it makes that stage's
    gradients (``fresh``) and whether it is a split backward's input part (``input_part``: no weight gradients).

    Stage 0 has no input gradient: its split backward runs whole in the input part (as the runtime's ``_Stage``).
    """
    where = {s: k for k, s in enumerate(local)}
    alive, pending, grads = [0] * len(local), [0] * len(local), [False] * len(local)
    states = [_State(tuple(alive), tuple(pending), tuple(grads))]
    for kind, s, _ in order:
        k = where[s]
        if kind == "F":
            alive[k] += 1
        elif kind == "I" and s > 0:
            states.append(_State(tuple(alive), tuple(pending), tuple(grads), k, input_part=True))
            pending[k] += 1
        elif kind == "W" and s == 0:
            continue
        else:  # a whole backward (B, or stage 0's I), or a weight part
            states.append(_State(tuple(alive), tuple(pending), tuple(grads), k, not grads[k]))
            grads[k] = True
            alive[k] -= 1
            pending[k] -= kind == "W"
        states.append(_State(tuple(alive), tuple(pending), tuple(grads)))
    return states


class MemoryModel:
    """Peak bytes of every rank of a pipeline for any split (see the module docstring).

    Args:
        layers: every layer's bytes (:class:`LayerBytes`).
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES`.
        n_ranks: pipeline ranks.
        n_microbatches: micro-batches per step.
        stages_per_rank: stages per rank.
    """

    def __init__(
        self,
        layers: Sequence[LayerBytes],
        schedule: str,
        n_ranks: int,
        n_microbatches: int,
        stages_per_rank: int = 1,
    ) -> None:
        self.layers = list(layers)
        self.schedule, self.n_ranks, self.n_microbatches = schedule, n_ranks, n_microbatches
        self.stages_per_rank = stages_per_rank
        self.n_stages = n_ranks * stages_per_rank
        self.ranks = stage_ranks(schedule, n_ranks, stages_per_rank)

    @functools.cached_property
    def _states(self) -> list[tuple[list[int], list[_State]]]:
        """Per rank, its local stages and the states of its task order (split-independent, made once)."""
        orders = rank_orders(self.schedule, self.n_ranks, self.n_microbatches, self.stages_per_rank)
        out = []
        for rank, order in enumerate(orders):
            local = [s for s, r in enumerate(self.ranks) if r == rank]
            out.append((local, _rank_states(order, local)))
        return out

    def stage_parts(self, layers_per_stage: Sequence[int]) -> list[dict[str, float]]:
        """Per stage what :meth:`peaks` adds up.

        ``static``, ``grads``, ``per_microbatch``, ``pending``, and the backward's transients ``fresh`` (it makes
        the stage's gradients), ``again`` (it adds to them) and ``input`` (a split backward's input part).
        """
        if len(layers_per_stage) != self.n_stages:
            raise ValueError(f"a split of {len(layers_per_stage)} stages for a model of {self.n_stages}")
        starts = [sum(layers_per_stage[:s]) for s in range(self.n_stages + 1)]
        return [self._part(s, self.layers[starts[s] : starts[s + 1]], starts[s + 1]) for s in range(self.n_stages)]

    def _part(self, s: int, own: list[LayerBytes], end: int) -> dict[str, float]:
        m = self.n_microbatches
        received = own[0].inputs if s > 0 else 0.0
        last = s == self.n_stages - 1
        output = own[-1].outputs if last else self.layers[end].inputs  # held per micro-batch until its backward
        # The backward of layer j runs after those of the layers behind it: their activations are gone, their
        # gradients made; the gradient of its output, which the layer behind it made (the stage's last layer's is a
        # receive buffer), is held until it is done.
        fresh = again = split_input = -math.inf
        later_act = later_grads = later_casts = incoming = 0.0
        for x in reversed(own):
            fresh = max(fresh, x.backward + incoming + later_grads + x.grads - later_act)
            split_input = max(split_input, x.backward_input + incoming - later_act)
            # the casts' gradients of the layers behind wait for the end of the pass (LayerBytes.cast_grads)
            again = max(again, x.backward_again + incoming - later_act + later_casts)
            later_act += x.activations
            later_grads += x.grads
            later_casts += x.cast_grads
            incoming = x.inputs
        # At the end of the pass, the activations gone and the stage's input gradient made, every cast's gradient
        # is turned to its weight's dtype (at most twice its size, one weight at a time) and added.
        casts_end = later_casts + 2 * max((x.cast_grads for x in own), default=0.0) + incoming - later_act
        again = max(again, casts_end) if later_casts else again
        return {
            # receive buffers: an input per micro-batch, and an output gradient (not on the last stage)
            "static": sum(x.static + x.copies for x in own) + m * (received + (0.0 if last else output)),
            "grads": later_grads,
            # the first layer keeps its input, which is the receive buffer (counted in ``static``)
            "per_microbatch": later_act - received + output,
            "pending": sum(x.split_extra for x in own),
            "fresh": fresh,
            "again": again,
            "input": split_input,
        }

    def peaks(self, layers_per_stage: Sequence[int]) -> list[float]:
        """Every rank's predicted peak bytes during a training step under the split."""
        parts = self.stage_parts(layers_per_stage)
        out = []
        for local, states in self._states:
            peak = 0.0
            for state in states:
                held = sum(
                    state.alive[k] * parts[s]["per_microbatch"]
                    + state.pending[k] * parts[s]["pending"]
                    + (parts[s]["grads"] if state.grads[k] else 0.0)
                    for k, s in enumerate(local)
                )
                if state.backward >= 0:
                    held += state.transient(parts[local[state.backward]])
                peak = max(peak, held)
            out.append(sum(parts[s]["static"] for s in local) + peak)
        return out

    def inflight(self) -> list[int]:
        """The most micro-batches every stage holds at once under the schedule (split-independent)."""
        most = [0] * self.n_stages
        for local, states in self._states:
            for state in states:
                for k, s in enumerate(local):
                    most[s] = max(most[s], state.alive[k])
        return most

    def migration_peaks(self, old: Sequence[int], new: Sequence[int]) -> list[float]:
        """Every rank's bytes while layers move from split ``old`` to ``new`` (between steps: no activations).

        Until the commit a rank holds its old layers' weights and optimizer state and those it receives (a moving
        layer is on both ends); the stages' receive buffers are dropped before anything moves.
        """
        old_ranks, new_ranks = self._rank_of_layers(old), self._rank_of_layers(new)
        held = [0.0] * self.n_ranks
        for layer, src, dst in zip(self.layers, old_ranks, new_ranks, strict=True):
            held[src] += layer.static
            if dst != src:
                held[dst] += layer.static
        return held

    def _rank_of_layers(self, split: Sequence[int]) -> list[int]:
        if len(split) != self.n_stages or sum(split) != len(self.layers):
            raise ValueError(f"split {list(split)} is not one of {len(self.layers)} layers over {self.n_stages} stages")
        return [self.ranks[s] for s, n in enumerate(split) for _ in range(n)]


def additive(layers: Sequence[LayerBytes], inflight: int) -> list[float]:
    """The per-layer sum the planner checked before this model (one in-flight count for every stage).

    Weights, gradients, state and ``inflight`` times the activations, per layer: no receive buffers, no outputs
    held, no backward transient.
    """
    return [x.params + x.grads + x.optim + inflight * x.activations for x in layers]


class MemoryCheck:
    """Whether splits fit a memory capacity, by the predicted peaks of :class:`MemoryModel` (what plans check).

    Args:
        layers: every layer's bytes.
        schedule: the schedule.
        n_microbatches: micro-batches per step.
        stages_per_rank: stages per rank.
        capacity: bytes a process may hold: one number, or one per stage (a process holding several stages gets
            the smallest of theirs; a split over another number of stages, a repack's, the smallest of all).
    """

    def __init__(
        self,
        layers: Sequence[LayerBytes],
        schedule: str,
        n_microbatches: int,
        stages_per_rank: int,
        capacity: float | Sequence[float],
    ) -> None:
        self.layers, self.schedule, self.n_microbatches = list(layers), schedule, n_microbatches
        self.stages_per_rank = stages_per_rank
        self.capacity = [float(capacity)] if isinstance(capacity, (int, float)) else [float(c) for c in capacity]
        self._models: dict[int, MemoryModel] = {}

    def model(self, n_stages: int) -> MemoryModel:
        """The memory model of a pipeline of ``n_stages`` stages (made once per size)."""
        if n_stages not in self._models:
            n_ranks = max(1, n_stages // self.stages_per_rank)
            self._models[n_stages] = MemoryModel(self.layers, self.schedule, n_ranks, self.n_microbatches,
                                                 self.stages_per_rank)  # fmt: skip
        return self._models[n_stages]

    def capacities(self, n_stages: int) -> list[float]:
        """Every rank's capacity in a pipeline of ``n_stages`` stages."""
        model = self.model(n_stages)
        if len(self.capacity) == 1 or len(self.capacity) != n_stages:
            return [min(self.capacity)] * model.n_ranks
        return [min(c for c, r in zip(self.capacity, model.ranks, strict=True) if r == rank)
                for rank in range(model.n_ranks)]  # fmt: skip

    def peaks(self, split: Sequence[int]) -> list[float]:
        """Every rank's predicted peak under ``split``."""
        return self.model(len(split)).peaks(split)

    def fits(self, split: Sequence[int]) -> bool:
        """Whether every rank's predicted peak under ``split`` is within its capacity."""
        caps = self.capacities(len(split))
        return all(p <= c for p, c in zip(self.peaks(split), caps, strict=True))

    def stage_bound(self, n_stages: int, stage: int, start: int, end: int) -> float:
        """A lower bound of the peak of ``stage``'s rank when it holds layers ``start..end`` (for pruning).

        The stage alone, at the state of its task order where it holds the most, without its output's buffers and
        transients: it grows with ``end``, so a search can stop extending a stage once it exceeds the capacity.
        """
        model, m = self.model(n_stages), self.n_microbatches
        own = self.layers[start:end]
        received = own[0].inputs if stage > 0 else 0.0
        act = sum(x.activations for x in own) - received
        grads = sum(x.grads for x in own)
        most = 0.0
        for local, states in model._states:
            if stage in local:
                k = local.index(stage)
                most = max(state.alive[k] * act + (grads if state.grads[k] else 0.0) for state in states)
        return sum(x.static + x.copies for x in own) + m * received + max(0.0, most)

    def stage_fits(self, n_stages: int, stage: int, start: int, end: int) -> bool:
        """Whether :meth:`stage_bound` is within the capacity of the stage's rank."""
        rank = self.model(n_stages).ranks[stage]
        return self.stage_bound(n_stages, stage, start, end) <= self.capacities(n_stages)[rank]

    def migration_fits(self, old: Sequence[int], new: Sequence[int]) -> bool:
        """Whether every rank stays within its capacity while layers move from ``old`` to ``new``."""
        caps = self.capacities(len(old))
        return all(p <= c for p, c in zip(self.model(len(old)).migration_peaks(old, new), caps, strict=True))

    def staged(self, old: Sequence[int], new: Sequence[int]) -> list[list[int]] | None:
        """Splits from ``old`` to ``new`` whose every move fits (the last is ``new``), or ``None`` if none does.

        At once if that fits; else every cut moves by one layer at a time towards its place in ``new`` (at most
        one layer crosses each boundary per move), which holds the least of the moving layers on the way.
        """
        if self.migration_fits(old, new):
            return [list(new)]
        cuts, target = _cuts(old), _cuts(new)
        steps, current = [], list(old)
        while cuts != target:
            cuts = [c + (t > c) - (t < c) for c, t in zip(cuts, target, strict=True)]
            split = [b - a for a, b in zip([0, *cuts], [*cuts, len(self.layers)], strict=True)]
            if min(split) < 1 or not self.migration_fits(current, split):
                return None
            steps.append(split)
            current = split
        return steps

    def feasible(self, n_stages: int) -> list[int] | None:
        """A split of ``n_stages`` stages that fits, the most evenly filled one found, or ``None``.

        Exact with one stage per rank (each rank's peak is its stage's, priced whole): the split minimising the
        largest ratio of peak to capacity, by dynamic programming over cut positions. With several stages per rank
        the same search on the stages' bounds, checked whole.
        """
        n, caps = len(self.layers), self.capacities(n_stages)
        model = self.model(n_stages)
        single = model.n_ranks == n_stages
        best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0.0, [])}
        for stage in range(n_stages):
            left = n_stages - stage - 1
            nxt: dict[tuple[int, int], tuple[float, list[int]]] = {}
            for (_, start), (worst, split) in best.items():
                for end in range(start + 1, n - left + 1):
                    ratio = self._stage_ratio(model, stage, start, end, caps, single)
                    score = max(worst, ratio)
                    if (stage + 1, end) not in nxt or score < nxt[(stage + 1, end)][0]:
                        nxt[(stage + 1, end)] = (score, [*split, end - start])
            best = nxt
        found = best.get((n_stages, n))
        if found is None or found[0] > 1.0 or not self.fits(found[1]):
            return None
        return found[1]

    def _stage_ratio(
        self, model: MemoryModel, stage: int, start: int, end: int, caps: list[float], single: bool
    ) -> float:
        rank = model.ranks[stage]
        if not single:
            return self.stage_bound(model.n_stages, stage, start, end) / caps[rank]
        part = model._part(stage, self.layers[start:end], end)
        _, states = model._states[rank]
        peak = max(
            state.alive[0] * part["per_microbatch"] + state.pending[0] * part["pending"]
            + (part["grads"] if state.grads[0] else 0.0)
            + state.transient(part)
            for state in states
        )  # fmt: skip
        return (part["static"] + peak) / caps[rank]

    def spread(self, split: Sequence[int]) -> float:
        """Largest over smallest predicted peak of the ranks under ``split``."""
        peaks = self.peaks(split)
        return max(peaks) / max(min(peaks), 1.0)


def _cuts(split: Sequence[int]) -> list[int]:
    return [sum(split[: s + 1]) for s in range(len(split) - 1)]
