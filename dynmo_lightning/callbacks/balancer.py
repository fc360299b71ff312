"""DynMoBalancer: measure per-layer cost while training, re-partition, and migrate layers when it pays.

Every ``profile_every_n_steps`` steps (after ``warmup_steps``) one training step is profiled on every stage; the
measurements are gathered to all processes and smoothed (:class:`~dynmo_lightning.balance.CostTracker`). Every
``every_n_steps`` steps the balancer plans a partition of the smoothed forward+backward costs with ``method`` and
migrates only when the pipeline cost model predicts that the time saved until the next check exceeds the predicted
migration time, and the relative step-time gain exceeds ``min_gain``. Every process computes the same decision from
the same gathered numbers, so no extra agreement round is needed.

With ``method="diffusion"`` the plan and the keep / migrate decision need no gathered costs: each stage runs its
share of the neighbour protocol from its own layers' costs (:mod:`~dynmo_lightning.pipeline.stage.neighbours`), and the
decision is taken from per-stage sums the stages pass along the chain.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import Self, override

from dynmo_lightning import balance
from dynmo_lightning.balance import CostTracker
from dynmo_lightning.balance.decision.policy import GROW, MIGRATE, REPACK, BalancePolicy, Decision, PipelineShape
from dynmo_lightning.balance.decision.policy_settings import METHODS, BalanceSettings
from dynmo_lightning.balance.split.placement import rank_stages
from dynmo_lightning.core.composition import Composition, refuse
from dynmo_lightning.core.control import JobShape, Rebalancing, pipeline_control
from dynmo_lightning.pipeline.elastic.release import RELEASE_TO, ReleaseEvent, ReleaseHandler, make_release_handler
from dynmo_lightning.pipeline.elastic.survivors import ON_RELEASE
from dynmo_lightning.profiling import device_memory
from dynmo_lightning.settings import build, configured_by, from_settings

__all__ = ["METHODS", "ON_RELEASE", "RELEASE_TO", "BalancerSettings", "DynMoBalancer"]


@dataclasses.dataclass(kw_only=True)
class BalancerSettings(BalanceSettings):
    """:class:`DynMoBalancer`'s settings (Hydra: the keys of the ``balancer`` group).

    The policy's (:class:`~dynmo_lightning.balance.decision.policy_settings.BalanceSettings`) and what a process
    released by a consolidation does.
    """

    on_release: str = "exit"
    """What a released process does: ``"exit"`` (leave ``fit`` and exit with status 0 now), ``"wait"`` (idle,
    holding no memory for layers, until training ends) or ``"data_parallel"`` (released processes that make a whole
    pipeline become a new data-parallel replica, splitting the batch of the replica they came from: same global
    batch, more throughput; the rest exit)."""
    release_to: str | ReleaseHandler = "none"
    """Who is told of a release, to take the freed resources back: ``"none"``, ``"slurm"`` (shrink the Slurm
    allocation to the kept nodes with ``scontrol update`` and give the survivors the resized job's environment),
    ``"command"`` (run ``release_command`` with the release as JSON on its standard input), or a callable taking a
    :class:`~dynmo_lightning.pipeline.elastic.release.ReleaseEvent`. Its failure is logged and never stops training."""
    release_command: str | None = None
    """The shell command of ``release_to="command"``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_release not in ON_RELEASE:
            raise ValueError(f"balancer.on_release={self.on_release!r} is not one of {list(ON_RELEASE)}")


class DynMoBalancer(Callback):
    """Dynamic load balancing of a :class:`~dynmo_lightning.DynMoStrategy` pipeline.

    Every setting is a field of :class:`BalancerSettings` (its docstrings say what each does; one name and one
    default, shared with the Hydra group ``balancer``): give them as keyword arguments,
    ``DynMoBalancer(every_n_steps=20, repack=True)``, or as one settings object,
    ``DynMoBalancer.from_settings(settings)``.

    Raises:
        ValueError: a setting is out of range (the message names it as ``balancer.<name>``).
        TypeError: an unknown or renamed setting (the message names the one it is now).
    """

    @configured_by(BalancerSettings)
    def __init__(self, **kwargs: Any) -> None:
        settings = self.settings = build(BalancerSettings, "DynMoBalancer", "balancer", kwargs)
        self.release_to = make_release_handler(settings.release_to, settings.release_command)
        policy = {f.name: getattr(settings, f.name) for f in dataclasses.fields(BalanceSettings)}
        self.policy = BalancePolicy(BalanceSettings(**policy))
        self.history: list[dict[str, Any]] = []
        self._restored: dict[str, Any] | None = None
        self._profiling = False
        #: Every layer's costs of the last step this balancer profiled (all layers, gathered from all stages).
        self.last_measured: dict[int, dict[str, float]] | None = None
        self._bound: Rebalancing | None = None

    @classmethod
    def from_settings(cls, settings: BalancerSettings, **overrides: Any) -> Self:
        """The balancer of one settings object (``overrides`` replace some of its fields)."""
        return from_settings(cls, BalancerSettings, settings, overrides)

    @property
    def tracker(self) -> CostTracker | None:
        """The smoothed per-layer costs the policy plans from."""
        return self.policy.tracker

    @property
    def bandwidth(self) -> float:
        """Bytes per second of layer migration (measured once layers have moved)."""
        return self.policy.bandwidth

    # ----------------------------------------------------------------------------------------------------------------
    def _strategy(self, trainer: pl.Trainer) -> Rebalancing:
        control = pipeline_control(trainer, Rebalancing)
        if control is None:
            raise TypeError(
                f"DynMoBalancer needs Trainer(strategy=DynMoStrategy(...)) (or strategy='dynmo'), got "
                f"{type(trainer.strategy).__name__}"
            )
        return control

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._bound = control = self._strategy(trainer)
        if self.settings.memory_capacity == "auto":
            # what the device has for this process as training starts (others' memory is not): None on CPU
            usable = device_memory(trainer.strategy.root_device)
            capacity = None if usable is None else usable * (1.0 - self.settings.memory_margin)
            self.policy.settings = dataclasses.replace(self.policy.settings, memory_capacity=capacity)
        self.pipeline_check_job(JobShape(control.world_size, control.pp_size, control.stages_per_rank, None,
                                         control.data_parallel, control.tensor_parallel_size))  # fmt: skip

    def pipeline_check_job(self, job: JobShape) -> None:
        """Refuse settings the job's size contradicts (the launching process calls this before any worker starts).

        Raises:
            ValueError: ``min_stages`` above the pipeline's processes, ``repack`` with several stages per rank, or
                with FSDP2 / replicate units or tensor parallelism, a ``memory_capacity`` list of the wrong length
                or one that cannot hold the model's weights.
        """
        self._check_repack(job)
        self._check_memory_capacity(job)

    def _check_repack(self, job: JobShape) -> None:
        """Refuse ``repack`` on a job whose world a consolidation could not restart on fewer processes.

        Args:
            job: the job's size and layout.

        Raises:
            ValueError: ``min_stages`` above the pipeline's processes; then what cannot compose with a
                consolidation (``core/composition.REFUSALS``): several stages per rank, one stage left for tied ends
                under FSDP2 / replicate units, released processes becoming DDP replicas of split stages, or waiting
                with replicas or tensor parallelism.
        """
        if not self.settings.repack:
            return
        if self.settings.min_stages > job.pp_size:
            raise ValueError(
                f"balancer.min_stages={self.settings.min_stages} > the pipeline's {job.pp_size} processes: lower it "
                "(or start more processes)"
            )
        s = self.settings
        refuse(Composition(job.data_parallel, job.data_parallel_size, job.tensor_parallel_size,
                           stages_per_rank=job.stages_per_rank, repack=True, on_release=s.on_release,
                           min_stages=s.min_stages, tied_ends=job.tied_ends))  # fmt: skip

    def _check_memory_capacity(self, job: JobShape) -> None:
        """Refuse a ``memory_capacity`` of the wrong length, or one that cannot hold the model's weights.

        Args:
            job: the job's size and, when the launching process could tell, its layers' parameter bytes.

        Raises:
            ValueError: a list of capacities not one per stage, or capacities below the largest layer's or all
                layers' weights.
        """
        capacity = self.settings.memory_capacity
        if capacity is None or capacity == "auto":  # "auto": the device's memory, known on the workers
            return
        caps = list(capacity) if isinstance(capacity, (list, tuple)) else [float(capacity)] * job.n_stages
        if len(caps) != job.n_stages:
            raise ValueError(
                f"balancer.memory_capacity has {len(caps)} entries for the job's {job.n_stages} pipeline stages: "
                "give one number (every stage) or one per stage"
            )
        # A lower bound: the weights as a process holds them at rest (its shards under fsdp), nothing else.
        sizes = [int(b * job.held_fraction) for b in job.layer_param_bytes or []]
        if sizes and (max(sizes) > max(caps) or sum(sizes) > sum(caps)):
            raise ValueError(
                f"balancer.memory_capacity={capacity} bytes cannot hold the model: its largest layer's weights "
                f"alone are {max(sizes):,} bytes and all layers' {sum(sizes):,} bytes over {job.n_stages} stages "
                f"{_on_top(job)}. Raise it, or set balancer.memory_capacity=null to plan without memory."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        self.policy.start(strategy.n_layers)
        if self._restored is not None:
            self._resume(strategy, self._restored)
            self._restored = None

    def _resume(self, strategy: Rebalancing, state: dict[str, Any]) -> None:
        """Start a resumed run from the balanced split (re-planned when the number of stages changed)."""
        self.policy.load_state_dict(state, strategy.n_layers)
        saved = state.get("partition")
        assert self.tracker is not None
        if saved is not None and len(saved) == strategy.n_stages:
            strategy.repartition(list(saved))
        elif self.tracker.samples and self.settings.method != "random":
            strategy.repartition(self.policy.plan(self._shape(strategy))[0])

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        strategy = self._strategy(trainer)
        changed = strategy.changed_layers(trainer.global_step)
        if changed:  # a dynamics callback froze or pruned layers after the last step: react
            self.policy.layers_changed(changed)
        self._profiling = self.policy.wants_profile(trainer.global_step)
        if self._profiling:
            strategy.request_profile()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self._strategy(trainer)
        if self._profiling:
            measured = strategy.profile_results()
            if measured is not None:
                self.policy.observe(measured)
                self.last_measured = measured
            self._profiling = False
        if self.policy.due(trainer.global_step):  # optimizer steps done, this one included
            self._check(trainer, pl_module, strategy)

    def _shape(self, strategy: Rebalancing) -> PipelineShape:
        return PipelineShape(
            strategy.layers_per_stage,
            strategy.pp_size,
            strategy.n_microbatches,
            strategy.schedule,
            strategy.layer_param_counts,
            strategy.pipeline_nodes,
            strategy.waiting,
            strategy.fsdp_memory_in_force,
            strategy.fsdp_memory == "auto",
        )

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: Rebalancing) -> None:
        t0 = time.perf_counter()
        shape = self._shape(strategy)
        if self.settings.method == "diffusion" and strategy.stages_per_rank == 1 and strategy.pp_size > 1:
            # Between neighbours: each stage plans from its own layers' costs; no per-layer cost is gathered.
            run = strategy.run_neighbours(lambda stage: self.policy.diffusion_stage(shape, stage))
            info = {"diffusion_rounds": run.rounds, "diffusion_probes": run.probes,
                    "diffusion_bytes": run.bytes_sent, "diffusion_s": run.seconds}  # fmt: skip
            decisions = self.policy.decide(shape, run.outcome, info)
        else:
            decisions = self.policy.decide(shape)
        plan_s = time.perf_counter() - t0
        # Decided once, by global rank 0, for every process of the job: the inputs agree (costs are gathered), but
        # the bandwidth estimate is each process's own timing, and a split decision would deadlock the migration.
        decisions = strategy.broadcast(decisions)
        way = decisions[0].info.get("fsdp_memory")
        if way == "lean":  # before layers move: the split planned fits the lean way only
            self._switch_fsdp_memory(trainer, strategy, way)
        for decision in decisions:
            if decision.action == REPACK:
                self._consolidate(trainer, pl_module, strategy, decision)
            elif decision.action == GROW:
                self._grow(trainer, pl_module, strategy, decision)
            else:
                self._migrate(trainer, pl_module, strategy, decision, plan_s)
        if way == "fast":  # after layers moved: the split planned fits the fast way
            self._switch_fsdp_memory(trainer, strategy, way)

    def _switch_fsdp_memory(self, trainer: pl.Trainer, strategy: Rebalancing, way: str) -> None:
        """Hold FSDP2 units' weights and gradients ``way`` from the next step on (``fsdp_memory="auto"``)."""
        if way == strategy.fsdp_memory_in_force:
            return
        strategy.set_fsdp_memory(way)
        self.history.append({"step": trainer.global_step, "fsdp_memory": way})
        rank_zero_info(
            f"DynMo: FSDP2 units run the {way} way from step {trainer.global_step} on "
            f"(strategy.fsdp_memory='auto', balancer.memory_capacity={self.settings.memory_capacity})"
        )

    def _migrate(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        strategy: Rebalancing,
        decision: Decision,
        plan_s: float,
    ) -> None:
        migrate_s, moved = 0.0, 0
        if decision.action == MIGRATE:
            transfer_s = 0.0
            for split in (*decision.steps, decision.proposed):  # in parts where at once would not fit in memory
                stats = strategy.repartition(split)
                migrate_s, moved = migrate_s + stats.seconds, moved + stats.bytes_sent + stats.bytes_received
                transfer_s += stats.transfer_seconds
            self.policy.record_migration(moved, transfer_s)  # without first-contact link set-up
        record = {
            "step": trainer.global_step,
            "current": decision.current,
            "proposed": decision.proposed,
            "migrated": decision.action == MIGRATE,
            "steps": len(decision.steps) + 1 if decision.action == MIGRATE else 0,
            "predicted_saving_s": decision.saving_s,
            "predicted_migration_s": decision.migration_s,
            "current_step_s": decision.current_step_s,
            "predicted_step_s": decision.predicted_step_s,
            "plan_s": plan_s,
            "migrate_s": migrate_s,
            "bytes_moved": moved,
            "speeds": list(self.policy.speeds.in_force or []),
            **decision.info,
        }
        self.history.append(record)
        self._log(pl_module, strategy, record)

    def _consolidate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: Rebalancing, decision: Decision
    ) -> None:
        """Pack onto fewer processes (released processes leave ``fit`` here)."""
        assert decision.keep_ranks is not None
        world_before = strategy.world_size
        self.history.append(
            {
                "step": trainer.global_step,
                "repack": decision.keep_ranks,
                "proposed": decision.proposed,
                "predicted_step_s": decision.predicted_step_s,
                "current_step_s": decision.current_step_s,
                **decision.info,
            }
        )
        freed = decision.info.get("freed_nodes")
        rank_zero_info(
            f"DynMo consolidation at step {trainer.global_step}: {len(decision.keep_ranks)} of {strategy.pp_size} "
            f"pipeline ranks kept ({decision.keep_ranks}); whole nodes freed: {freed if freed else 'none'}"
        )
        slow = self._slow_released(decision.keep_ranks)
        release_to = self.release_to if not slow else _naming_slow(self.release_to, slow)
        stats = strategy.shrink(decision.keep_ranks, decision.proposed, on_release=self.settings.on_release,
                                release_to=release_to)  # fmt: skip
        self.policy.carried_out(decision)
        pl_module.log_dict(
            {
                "balancer/world_size": float(strategy.world_size),
                "balancer/pipeline_size": float(strategy.pp_size),
                "balancer/replicas": float(strategy.dp_size),
                "balancer/released": float(world_before - strategy.world_size),
                "balancer/repack_ms": 1e3 * stats.seconds,
            },
            on_step=True,
            on_epoch=False,
        )

    def _grow(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: Rebalancing, decision: Decision
    ) -> None:
        """Re-admit waiting processes as new stages (more stages pay again)."""
        record = {"step": trainer.global_step, "grow": decision.info.get("admit"), "proposed": decision.proposed,
                  "predicted_step_s": decision.predicted_step_s, "current_step_s": decision.current_step_s}  # fmt: skip
        self.history.append(record)
        stats = strategy.grow(decision.proposed)
        self.policy.carried_out(decision)
        pl_module.log_dict(
            {"balancer/world_size": float(strategy.world_size), "balancer/grow_ms": 1e3 * stats.seconds},
            on_step=True,
            on_epoch=False,
        )

    def _slow_released(self, keep_ranks: list[int]) -> dict[int, float]:
        """The pipeline ranks a consolidation releases that were measured slow, with their speeds."""
        speeds = self.policy.speeds.in_force or []
        bar = 1.0 - self.policy.settings.speed_tolerance
        return {r: v for r, v in enumerate(speeds) if r not in keep_ranks and v < bar}

    def _log(self, pl_module: pl.LightningModule, strategy: Rebalancing, record: dict[str, Any]) -> None:
        assert self.tracker is not None
        predicted = balance.stage_loads(self.tracker.compute, strategy.layers_per_stage)
        metrics = {
            "balancer/migrated": float(record["migrated"]),
            "balancer/plan_ms": 1e3 * record["plan_s"],
            "balancer/migrate_ms": 1e3 * record["migrate_s"],
            "balancer/imbalance_predicted": balance.imbalance(_rank_loads(predicted, strategy)),
        }
        if "diffusion_rounds" in record:
            metrics["balancer/diffusion_rounds"] = float(record["diffusion_rounds"])
        if "diffusion_bytes" in record:  # between neighbours; several stages per rank diffuse in one process
            metrics["balancer/diffusion_bytes"] = float(record["diffusion_bytes"])
            metrics["balancer/diffusion_ms"] = 1e3 * record["diffusion_s"]
        if self.last_measured is not None:
            last = self.last_measured
            measured_costs = [last[i]["fwd"] + last[i]["bwd"] for i in range(strategy.n_layers)]
            measured = balance.stage_loads(measured_costs, record["current"])
            metrics["balancer/imbalance_measured"] = balance.imbalance(_rank_loads(measured, strategy))
            for s, load in enumerate(measured):
                metrics[f"balancer/stage{s}_load_measured_ms"] = 1e3 * load
            if strategy.stages_per_rank > 1:
                for r, load in enumerate(_rank_loads(measured, strategy)):
                    metrics[f"balancer/rank{r}_load_measured_ms"] = 1e3 * load
        for r, speed in enumerate(self.policy.speeds.in_force or []):
            metrics[f"balancer/rank{r}_speed"] = speed
        for s, (load, n) in enumerate(zip(predicted, strategy.layers_per_stage, strict=True)):
            metrics[f"balancer/stage{s}_load_predicted_ms"] = 1e3 * load
            metrics[f"balancer/stage{s}_layers"] = float(n)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.policy.state_dict(),
            "partition": self._bound.layers_per_stage if self._bound is not None else None,
            "history": self.history,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Mid-run (a process re-admitted by a grow) the tracker is restored at once: every process profiles and
        # checks on the same steps.
        self.policy.load_state_dict(state_dict, self._bound.n_layers if self._bound is not None else None)
        self.history = list(state_dict.get("history", []))
        self._restored = state_dict


def _rank_loads(stage_loads: list[float], strategy: Rebalancing) -> list[float]:
    """Every pipeline rank's load: the sum of its stages' (a rank runs its stages one after the other)."""
    if len(stage_loads) != strategy.pp_size * strategy.stages_per_rank:
        return stage_loads  # the split of another pipeline (before a resize): per stage
    owned = rank_stages(strategy.schedule, strategy.pp_size, strategy.stages_per_rank)
    return [sum(stage_loads[s] for s in stages) for stages in owned]


def _naming_slow(handler: ReleaseHandler, slow: dict[int, float]) -> ReleaseHandler:
    """``handler`` told which released pipeline ranks were slow (``ReleaseEvent.slow_pipeline_ranks``, speeds)."""

    def told(event: ReleaseEvent) -> Any:
        return handler(dataclasses.replace(event, slow_pipeline_ranks={str(r): v for r, v in slow.items()}))

    return told


def _on_top(job: JobShape) -> str:
    """What a step holds besides the weights the pre-launch check counts (as a process holds them at rest)."""
    if job.data_parallel != "fsdp":
        return "(gradients, optimizer state and activations come on top)"
    return (
        "(as a process holds them at rest under fsdp: 1/D of each layer; during a step it holds more: under "
        "strategy.fsdp_memory='fast', the default, its stage's gathered weights and whole gradients, under "
        "'lean' one layer's at a time; optimizer state and activations come on top)"
    )
