"""THE balancing decision: keep the split, migrate to a better one, or repack onto fewer ranks.

The runtime balancer (:class:`~dynmo_lightning.callbacks.DynMoBalancer`) and the trace replay
(:func:`~dynmo_lightning.sim.simulate_run`) both drive a :class:`BalancePolicy`, so a simulated run replays the
decisions the balancer makes, step for step. Pure planning: plain numbers in, plain data out.

A policy keeps what it has measured (a :class:`~dynmo_lightning.balance.CostTracker`) and its cadence:

* :meth:`BalancePolicy.wants_profile` - whether the step about to run should be profiled (one step in
  ``profile_every_n_steps`` after ``warmup_steps``, always the step before a check, and every step after an event);
* :meth:`BalancePolicy.observe` - fold a profiled step's per-layer costs into the tracker;
* :meth:`BalancePolicy.layers_changed` - an event: a dynamic technique changed layers (froze, pruned them). Their
  cost history restarts, the next ``react_samples`` steps are profiled, and then a check runs at once instead of
  waiting for the next multiple of ``every_n_steps``: the balancer reacts within a few steps, still planning from
  more than one measurement;
* :meth:`BalancePolicy.due` - whether a check is due once ``step`` optimizer steps are done;
* :meth:`BalancePolicy.decide` - the check itself: plan a split with ``method`` (``"optimal"`` and ``"static_time"``:
  the makespan-optimal split, :func:`~dynmo_lightning.balance.steptime.planner.makespan_split`), decide whether
  migrating to it pays (:func:`~dynmo_lightning.balance.steptime.closed_form.repartition_pays` on the two makespans of
  the schedule's own task order, :class:`~dynmo_lightning.balance.steptime.planner.StepModel`: the predicted saving
  until the next check beats the migration time, bytes to move over the bandwidth, and the relative gain beats
  ``min_gain``), then, with ``repack``, whether fewer ranks keep the step time
  (:func:`~dynmo_lightning.balance.plan_repack`) or, when released ranks wait to come back (``PipelineShape.waiting``),
  whether more stages pay again: a *grow*, when the pipeline's makespan is more than ``repack_tolerance`` above the full
  pipeline's best, to the fewest stages within it (charged like a migration: the bytes of the layers that change rank).
  Both aim at the same stage count for the same costs, so a shrink and a grow never undo each other.

The caller carries the decisions out (moves layers, or replays their cost) and reports measured migrations back with
:meth:`BalancePolicy.record_migration`, which updates the bandwidth estimate.

The measuring half (tracker, cadence, events, checkpointed state) is :class:`~.cadence.PolicyCadence`, which
:class:`BalancePolicy` extends; the pipeline it plans for is :class:`~.pipeline_shape.PipelineShape`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from dynmo_lightning.balance.decision.cadence import ONE_SHOT, PolicyCadence
from dynmo_lightning.balance.decision.pipeline_shape import PipelineShape
from dynmo_lightning.balance.decision.policy_settings import BalanceSettings
from dynmo_lightning.balance.decision.repack import best_split, plan_repack
from dynmo_lightning.balance.diffusion.driver import (
    DiffusionStage,
    StageOutcome,
    diffuse,
    require_outcome_fits,
    shared_capacity,
)
from dynmo_lightning.balance.partitioning.methods import partition
from dynmo_lightning.balance.split.fit import InfeasibleMemoryError
from dynmo_lightning.balance.split.loads import bytes_moved
from dynmo_lightning.balance.steptime.closed_form import repartition_pays
from dynmo_lightning.balance.steptime.makespan import makespan
from dynmo_lightning.balance.steptime.memory_model import MemoryCheck
from dynmo_lightning.balance.steptime.planner import StepModel, even_memory, makespan_split

__all__ = ["GROW", "KEEP", "MIGRATE", "ONE_SHOT", "REPACK", "BalancePolicy", "Decision", "PipelineShape"]

#: What a check can decide.
KEEP, MIGRATE, REPACK, GROW = "keep", "migrate", "repack", "grow"


@dataclasses.dataclass(frozen=True)
class Decision:
    """One outcome of a check, with the numbers behind it.

    Attributes:
        action: :data:`KEEP`, :data:`MIGRATE`, :data:`REPACK` or :data:`GROW`.
        current: the split before.
        proposed: the split after (the planned split, also when it is kept out of force).
        keep_ranks: for a repack, the current ranks that keep running (in order).
        current_step_s: predicted step time of ``current``.
        predicted_step_s: predicted step time of ``proposed``.
        bytes_moved: bytes of the layers that change rank.
        migration_s: predicted time of the move.
        saving_s: predicted saving until the next check (before subtracting ``migration_s``).
        info: method-specific numbers (``diffusion_rounds``; ``memory`` when a move was refused for its transient).
        steps: splits a migration passes through before ``proposed`` (moved in parts: the whole move at once
            would hold more than a rank's memory capacity on the way); empty: at once.
    """

    action: str
    current: list[int]
    proposed: list[int]
    keep_ranks: list[int] | None = None
    current_step_s: float = 0.0
    predicted_step_s: float = 0.0
    bytes_moved: float = 0.0
    migration_s: float = 0.0
    saving_s: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    steps: list[list[int]] = dataclasses.field(default_factory=list)


class BalancePolicy(PolicyCadence):
    """Measured costs, cadence and the keep / migrate / repack decision of DynMo's balancer.

    Made as :class:`~dynmo_lightning.balance.decision.cadence.PolicyCadence` is (the same arguments and errors).
    """

    def __init__(self, method: str | BalanceSettings = "optimal", **settings: Any) -> None:
        super().__init__(method, **settings)
        self._check: tuple[Any, MemoryCheck] | None = None  # the memory check of the costs in force, made once
        self._model: tuple[Any, StepModel, Any] | None = None

    # ----------------------------------------------------------------------------------------------------------------
    def plan(self, pipe: PipelineShape) -> tuple[list[int], dict[str, Any]]:
        """The split ``method`` proposes for the tracked costs (no decision, no state change but the random draw)."""
        n_layers, n_stages = sum(pipe.layers_per_stage), pipe.n_stages
        if self.settings.method == "random":
            cuts = sorted(self._rng.sample(range(1, n_layers), n_stages - 1))
            return [b - a for a, b in itertools.pairwise([0, *cuts, n_layers])], {}
        if self.settings.method == "params":
            if pipe.param_counts is None:
                raise ValueError("method='params' needs the layers' parameter counts")
            return partition(list(pipe.param_counts), n_stages, method="params"), {}
        assert self.tracker is not None
        if self.settings.method == "diffusion":
            memory, capacity = self._additive(pipe)
            result = diffuse(
                self.tracker.compute,
                pipe.layers_per_stage,
                memory=memory,
                capacity=capacity,
                mode=self.settings.diffusion_mode,
            )
            return result.layers_per_stage, {"diffusion_rounds": result.rounds}
        check, _ = self._memory(pipe)
        model = self.step_model(pipe)
        found = makespan_split(model, n_stages, memory=check)
        if found is None:
            assert check is not None
            raise InfeasibleMemoryError(_no_split_fits(check, pipe, self.settings.memory_capacity))
        if check is not None and self.settings.balance_memory:
            return even_memory(model, check, found[1], found[0], self.settings.balance_memory_cost), {}
        return found[1], {}

    def diffusion_stage(self, pipe: PipelineShape, stage: int) -> DiffusionStage:
        """Pipeline stage ``stage``'s machine of the diffusion protocol, from the tracked numbers of its OWN layers.

        Each layer travels as ``(compute, memory, fwd, bwd, bytes, weight part)``: the protocol balances the
        compute and keeps the memory within the capacity; the rest rides along so that the keep / migrate decision
        can be taken from per-stage sums (:meth:`decide` with ``planned``).
        """
        assert self.tracker is not None
        first = sum(pipe.layers_per_stage[:stage])
        own = range(first, first + pipe.layers_per_stage[stage])
        v, memory = self.tracker.values, self._additive(pipe)[0]
        compute, moving = self.tracker.compute, self.layer_bytes()
        mem = [0.0] * len(compute) if memory is None else memory
        wgt = v.get("bwd_weight") or [0.0] * len(compute)
        layers = [(compute[i], mem[i], v["fwd"][i], v["bwd"][i], moving[i], wgt[i]) for i in own]
        limit = shared_capacity(self._capacities(pipe))
        return DiffusionStage(
            stage,
            pipe.n_stages,
            first,
            layers,
            n_layers=len(compute),
            capacity=limit,
            mode=self.settings.diffusion_mode,
        )

    def decide(
        self, pipe: PipelineShape, planned: Sequence[StageOutcome] | None = None, info: dict[str, Any] | None = None
    ) -> list[Decision]:
        """Run a check: ``[keep or migrate]``, followed by a repack when ``repack`` finds one.

        Args:
            pipe: the pipeline now.
            planned: the outcome of the diffusion protocol run between the pipeline neighbours (stages built by
                :meth:`diffusion_stage`): the split is its sizes, and keep / migrate is decided from its per-stage
                sums alone. ``None``: plan here with ``method``.
            info: numbers of that run to keep with the decision (rounds, bytes).

        Returns:
            The decisions, to be carried out in order (a repack plans from the split after the migration).
        """
        self.full_stages = max(self.full_stages, pipe.n_ranks + pipe.waiting)
        pipe = self._choose_way(pipe)
        if planned is None:
            proposed, info = self.plan(pipe)
        else:
            require_outcome_fits(planned, shared_capacity(self._capacities(pipe)))
            proposed, info = [o.size for o in planned], dict(info or {})
        decision = self._migration(pipe, proposed, _with_way(pipe, info), planned)
        self.planned_once = True
        self.after_event = None
        decisions = [decision]
        if self.settings.repack and self.settings.method != "random" and pipe.n_ranks > self.settings.min_stages:
            after = decision.proposed if decision.action == MIGRATE else pipe.layers_per_stage
            repack = self._repack(dataclasses.replace(pipe, layers_per_stage=after))
            if repack is not None:
                decisions.append(repack)
        if self.settings.repack and self.settings.method != "random" and pipe.waiting and len(decisions) == 1:
            after = decision.proposed if decision.action == MIGRATE else pipe.layers_per_stage
            grow = self._grow(dataclasses.replace(pipe, layers_per_stage=after))
            if grow is not None:
                decisions.append(grow)
        return decisions

    def _choose_way(self, pipe: PipelineShape) -> PipelineShape:
        """``pipe`` with the way FSDP2 units should run (:meth:`choose_fsdp_memory`) where a check chooses it."""
        if not pipe.fsdp_memory_auto:
            return pipe
        return dataclasses.replace(pipe, fsdp_memory=self.choose_fsdp_memory(pipe))

    def choose_fsdp_memory(self, pipe: PipelineShape) -> str:
        """How FSDP2 units should hold a step's weights and gradients under ``fsdp_memory="auto"``.

        ``"fast"`` if some split of the pipeline's stages fits the memory capacity that way, else ``"lean"`` if one
        fits that way, else what is in force (planning then says that nothing fits). Fast is never slower than lean
        for the same split (one all-gather and one reduce-scatter per layer and step instead of ``2M`` and ``M``),
        so it is chosen whenever the capacity allows it; the times the planner then plans from are measured under
        the way in force (the lean way's communication included). Without a capacity (or before anything was
        measured) nothing changes.
        """
        capacity = self.settings.memory_capacity
        if capacity in (None, "auto") or self.tracker is None or not self.tracker.samples:
            return pipe.fsdp_memory
        for way in ("fast", "lean"):
            check = MemoryCheck(self.tracker.layer_memory(way), pipe.schedule, pipe.n_microbatches,
                                pipe.stages_per_rank, capacity)  # fmt: skip
            if check.feasible(pipe.n_stages) is not None:
                return way
        return pipe.fsdp_memory

    def _grow(self, pipe: PipelineShape) -> Decision | None:
        """More stages (up to ``pipe.waiting`` more) when the pipeline is slower than the repack tolerance allows.

        The target is the one a repack aims at: the fewest stages within ``repack_tolerance`` of the optimal split
        over the full pipeline (or, if none is, the fastest), so a shrink and a grow never undo each other on the
        same costs.
        """
        assert self.tracker is not None
        memory, capacity = self._memory(pipe)
        n_layers = self.tracker.n_layers
        model = self.step_model(pipe)

        def best(n_stages: int) -> tuple[float, list[int]] | None:
            on = model.for_ranks(n_stages // pipe.stages_per_rank)  # re-admitted ranks: unmeasured until they run
            return best_split(on, n_stages, memory=memory, capacity=capacity)

        now, full = self._step_time(pipe, pipe.layers_per_stage), best(min(self.full_stages, n_layers))
        bar = (1 + self.settings.repack_tolerance) * (full[0] if full is not None else now)
        if now <= bar:
            return None
        options = [
            b for n in range(pipe.n_stages + 1, min(pipe.n_stages + pipe.waiting, n_layers) + 1) if (b := best(n))
        ]
        if not options:
            return None
        t, split = next((o for o in options if o[0] <= bar), min(options, key=lambda o: o[0]))
        if now - t < self.settings.min_gain * now:
            return None
        # The re-admitted ranks join after the running ones (the kept ranks keep their order): layers change owner
        # where the new split puts them on another rank than now.
        moved = bytes_moved(pipe.layers_per_stage, split, self.layer_bytes())
        seconds = moved / self.bandwidth + self.settings.migration_overhead
        admit = {"admit": len(split) - pipe.n_stages}
        return Decision(GROW, list(pipe.layers_per_stage), split, None, now, t, moved, seconds, info=admit)

    def _migration(
        self, pipe: PipelineShape, proposed: list[int], info: dict[str, Any], planned: Sequence[StageOutcome] | None
    ) -> Decision:
        """Keep or migrate (:func:`~dynmo_lightning.balance.steptime.closed_form.should_repartition`'s rule).

        With ``planned`` (the diffusion protocol's outcome) only per-stage sums are used: each stage's forward and
        backward time before and after, and the bytes each stage receives - scalars per stage, no layer's cost.
        """
        current = list(pipe.layers_per_stage)
        if self.settings.method in ("random", "params") or proposed == current:
            return Decision(MIGRATE if proposed != current else KEEP, current, proposed, info=info)
        assert self.tracker is not None
        now, new, moved = self._price(pipe, current, proposed, planned)
        seconds = moved / self.bandwidth + self.settings.migration_overhead
        min_gain = self.settings.min_gain if self.settings.method != "static_time" else 0.0
        go, saving = repartition_pays(now, new, self.settings.every_n_steps, seconds, min_gain)
        steps = self._staged(pipe, current, proposed, info) if go else []
        go = go and steps is not None
        return Decision(MIGRATE if go else KEEP, current, proposed, None, now, new, moved, seconds, saving, info,
                        (steps or [])[:-1])  # fmt: skip

    def _price(
        self, pipe: PipelineShape, current: list[int], proposed: list[int], planned: Sequence[StageOutcome] | None
    ) -> tuple[float, float, float]:
        """The step times of the current and the proposed split, and the bytes the move between them carries.

        Args:
            pipe: the pipeline now.
            current: its split.
            proposed: the split to move to.
            planned: the diffusion protocol's outcome (only its per-stage sums are used), or ``None``.

        Returns:
            ``(now, new, moved)``: the makespans of ``current`` and ``proposed``, and the bytes moved.
        """
        if planned is None:
            # The planner's own step model, weight parts included: under a zero-bubble schedule the W tasks fill
            # the bubbles, and a makespan without them (every backward all input part) prices the two splits of a
            # V on another step than the one that runs (a 6.4 % gain read as 4.7 %, under min_gain: issue 38).
            model = self.step_model(pipe)
            now, new = model(current), model(proposed)
            return now, new, bytes_moved(current, proposed, self.layer_bytes(), pipe.n_ranks, pipe.schedule)
        # sums over (compute, memory, fwd, bwd, bytes, weight part), see diffusion_stage
        now, new = (self._makespan(pipe, *([o.old[i] for o in planned] for i in (2, 3, 5))),
                    self._makespan(pipe, *([o.new[i] for o in planned] for i in (2, 3, 5))))  # fmt: skip
        return now, new, math.fsum(o.received[4] for o in planned)

    def _staged(
        self, pipe: PipelineShape, current: list[int], proposed: list[int], info: dict[str, Any]
    ) -> list[list[int]] | None:
        """The splits a move goes through, each within memory on the way (``None``: refused, said in ``info``)."""
        check, _ = self._memory(pipe)
        if check is None:
            return [proposed]
        steps = check.staged(current, proposed)
        if steps is None:
            peaks = check.model(len(current)).migration_peaks(current, proposed)
            info["memory"] = (
                f"move refused: even one layer at a time it would hold up to {max(peaks) / 2**30:.2f} GiB on a rank "
                f"(balancer.memory_capacity={self.settings.memory_capacity})"
            )
        return steps

    def _repack(self, pipe: PipelineShape) -> Decision | None:
        assert self.tracker is not None
        v = self.tracker.values
        memory, capacity = self._memory(pipe)
        plan = plan_repack(
            v["fwd"],
            v["bwd"],
            pipe.layers_per_stage,
            n_microbatches=pipe.n_microbatches,
            schedule=pipe.schedule,
            p2p=self.settings.p2p_seconds,
            wgt=v.get("bwd_weight"),
            tolerance=self.settings.repack_tolerance,
            min_stages=self.settings.min_stages,
            layer_bytes=self.layer_bytes(),
            memory=memory,
            capacity=capacity,
            nodes=pipe.nodes,
            reference_stages=self.full_stages,
            model=self.step_model(pipe),
            speeds=self.speeds.planning(pipe.n_ranks) if self.settings.process_speeds else None,
        )
        if plan is None:
            return None
        seconds = plan.bytes_moved / self.bandwidth + self.settings.migration_overhead
        return Decision(
            REPACK,
            list(pipe.layers_per_stage),
            plan.layers_per_stage,
            plan.keep_ranks,
            plan.current_step_time,
            plan.step_time,
            plan.bytes_moved,
            seconds,
            info={"freed_nodes": plan.freed_nodes} if pipe.nodes is not None else {},
        )

    def layer_bytes(self) -> list[float]:
        """Bytes that move with each layer: its parameters plus their optimizer state."""
        assert self.tracker is not None
        v = self.tracker.values
        return [p + o for p, o in zip(v["param_bytes"], v["optim_bytes"], strict=True)]

    def step_model(self, pipe: PipelineShape) -> StepModel:
        """The makespan model of the tracked costs under ``pipe``'s schedule, micro-batches and placement.

        The weight-gradient part of each layer's backward (zero-bubble ``W`` tasks) is the tracker's ``"bwd_weight"``
        field: the profiler's split of the backward under a zero-bubble schedule, 0 elsewhere (all of it is input).
        With ``process_speeds``, each rank's stages take their (normalised) costs over its measured speed
        (:class:`~dynmo_lightning.balance.decision.speeds.ProcessSpeeds`).
        """
        assert self.tracker is not None
        v = self.tracker.values
        speeds = self.speeds.planning(pipe.n_ranks) if self.settings.process_speeds else None
        key = (pipe.n_microbatches, pipe.schedule, pipe.stages_per_rank, self.settings.p2p_seconds,
               None if speeds is None else tuple(speeds))  # fmt: skip
        costs = (list(v["fwd"]), list(v["bwd"]), list(v.get("bwd_weight") or []))
        if self._model is None or self._model[0] != key or self._model[2] != costs:
            model = StepModel(
                v["fwd"], v["bwd"], pipe.n_microbatches, pipe.schedule, self.settings.p2p_seconds,
                wgt=v.get("bwd_weight"), stages_per_rank=pipe.stages_per_rank, speeds=speeds,
            )  # fmt: skip
            self._model = (key, model, costs)
        return self._model[1]

    def carried_out(self, decision: Decision) -> None:
        """A repack or grow ran: the measured speeds follow the ranks that now run the pipeline."""
        if decision.action == REPACK and decision.keep_ranks is not None:
            self.speeds.keep(decision.keep_ranks)
        elif decision.action == GROW:
            self.speeds.grow(len(decision.proposed))

    def _step_time(self, pipe: PipelineShape, split: list[int]) -> float:
        return self.step_model(pipe)(split)

    def _makespan(
        self, pipe: PipelineShape, stage_fwd: Sequence[float], stage_bwd: Sequence[float], stage_wgt: Sequence[float]
    ) -> float:
        """The makespan from per-stage sums (all the diffusion protocol's outcome carries)."""
        return makespan(
            stage_fwd,
            stage_bwd,
            pipe.n_microbatches,
            pipe.schedule,
            self.settings.p2p_seconds,
            stage_wgt=stage_wgt,
            stages_per_rank=pipe.stages_per_rank,
        )

    def _capacities(self, pipe: PipelineShape) -> list[float] | None:
        """The memory capacity as a list (one entry, or one per stage), ``None`` without one."""
        capacity = self.settings.memory_capacity
        if capacity == "auto":
            return None
        return None if capacity is None else [capacity] if isinstance(capacity, (int, float)) else list(capacity)

    def _memory(self, pipe: PipelineShape) -> tuple[MemoryCheck | None, None]:
        """What plans must fit: every rank's predicted peak (:class:`~dynmo_lightning.balance.MemoryCheck`)."""
        if self.settings.memory_capacity in (None, "auto"):  # "auto" is resolved by the runtime balancer
            return None, None
        assert self.tracker is not None
        way = pipe.fsdp_memory if pipe.fsdp_memory_auto else None  # as measured, unless a check chooses the way
        key = (pipe.schedule, pipe.n_microbatches, pipe.stages_per_rank, self.tracker.samples, way)
        if self._check is None or self._check[0] != key:
            layers = self.tracker.layer_memory(way)
            check = MemoryCheck(layers, pipe.schedule, pipe.n_microbatches, pipe.stages_per_rank,
                                self.settings.memory_capacity)  # fmt: skip
            self._check = (key, check)
        return self._check[1], None

    def _additive(self, pipe: PipelineShape) -> tuple[list[float] | None, Any]:
        """The per-layer sum the diffusion protocol checks (each stage knows only its own layers)."""
        if self.settings.memory_capacity in (None, "auto"):
            return None, None
        assert self.tracker is not None
        return self.tracker.memory(pipe.inflight), self.settings.memory_capacity


def _with_way(pipe: PipelineShape, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with the way FSDP2 units are to run where a check chose it (the caller switches them if it changed)."""
    return {**info, "fsdp_memory": pipe.fsdp_memory} if pipe.fsdp_memory_auto else info


def _no_split_fits(check: MemoryCheck, pipe: PipelineShape, capacity: Any) -> str:
    """Why no split of the pipeline fits its memory capacity: the predicted peaks of the most even split."""
    n = pipe.n_stages
    split = [len(check.layers) // n + (s < len(check.layers) % n) for s in range(n)]
    peaks = ", ".join(f"{p / 2**30:.2f}" for p in check.peaks(split))
    return (
        f"balancer.memory_capacity={capacity}: no split of the {len(check.layers)} layers over {n} stages fits; "
        f"under the {pipe.schedule} schedule with {pipe.n_microbatches} micro-batches the uniform split's ranks "
        f"peak at [{peaks}] GiB (weights, gradients, optimizer state, in-flight activations, receive buffers). "
        "Raise the capacity, use more stages or activation checkpointing, or lower the micro-batch size"
    )
