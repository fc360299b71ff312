"""DynMoBalancer: measure per-layer cost while training, re-partition, and migrate layers when it pays.

Every ``profile_every_n_steps`` steps (after ``warmup_steps``) one training step is profiled on every stage; the
measurements are gathered to all processes and smoothed (:class:`~dynmo_lightning.balance.CostTracker`). Every
``every_n_steps`` steps the balancer plans a partition of the smoothed forward+backward costs with ``method`` and
migrates only when the pipeline cost model predicts that the time saved until the next check exceeds the predicted
migration time, and the relative step-time gain exceeds ``min_gain``. Every process computes the same decision from
the same gathered numbers, so no extra agreement round is needed.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning import balance
from dynmo_lightning.balance import CostTracker
from dynmo_lightning.strategy import ON_RELEASE, DynMoStrategy

#: Planning methods of the balancer (``"random"`` migrates to a random valid split at every check: a chaos test of
#: layer migration, never a performance policy).
METHODS = ("optimal", "diffusion", "static_time", "params", "random")

#: Assumed bytes per second of a layer migration until one has been measured.
_DEFAULT_BANDWIDTH = 1e9


class DynMoBalancer(Callback):
    """Dynamic load balancing of a :class:`~dynmo_lightning.DynMoStrategy` pipeline.

    Args:
        every_n_steps: optimizer steps between balance checks.
        method: ``"optimal"`` (exact min-max split of measured costs, every check), ``"diffusion"`` (decentralised
            neighbour exchanges, every check), ``"static_time"`` (plan once from the first profile, never again,
            like torchgpipe's balance_by_time), ``"params"`` (balance parameter counts once, like DeepSpeed), or
            ``"random"`` (a random split at every check; for testing that migration never changes the math).
        min_gain: minimum predicted relative step-time improvement for a migration.
        warmup_steps: steps before profiling starts (the first steps include one-off set-up work).
        profile_every_n_steps: profile one step in this many (default: every ``every_n_steps // 5`` steps, at least
            every step before a check); profiling costs a little on the profiled step only.
        smoothing: weight of a new measurement in the moving average of layer costs.
        memory_capacity: bytes a stage may hold (one number, or one per stage); ``None`` ignores memory.
        p2p_seconds: predicted time of one activation transfer between stages (for the cost model).
        seed: seed of ``method="random"``.
        repack: after each check, consolidate onto the fewest processes predicted within ``repack_tolerance`` of
            the current step time, and release the others (see :meth:`DynMoStrategy.shrink`).
        repack_tolerance: accepted relative slow-down of a repack (0.05: 5 %).
        min_world_size: never consolidate a pipeline below this many processes.
        on_release: what a released process does: ``"exit"`` (leave ``fit`` and exit with status 0 now),
            ``"wait"`` (idle, holding no memory for layers, until training ends) or ``"data_parallel"`` (released
            processes that make a whole pipeline become a new data-parallel replica, splitting the batch of the
            replica they came from: same global batch, more throughput; the rest exit).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        method: str = "optimal",
        min_gain: float = 0.05,
        warmup_steps: int = 5,
        profile_every_n_steps: int | None = None,
        smoothing: float = 0.5,
        memory_capacity: float | list[float] | None = None,
        p2p_seconds: float = 0.0,
        seed: int = 0,
        repack: bool = False,
        repack_tolerance: float = 0.05,
        min_world_size: int = 1,
        on_release: str = "exit",
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"balancer.method={method!r} is not one of {list(METHODS)}")
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"balancer.every_n_steps={every_n_steps!r} must be an integer >= 1")
        if warmup_steps < 0:
            raise ValueError(f"balancer.warmup_steps={warmup_steps} must be >= 0")
        if profile_every_n_steps is not None and profile_every_n_steps < 1:
            raise ValueError(f"balancer.profile_every_n_steps={profile_every_n_steps} must be >= 1")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"balancer.smoothing={smoothing} must be in (0, 1]")
        if repack_tolerance < 0:
            raise ValueError(f"balancer.repack_tolerance={repack_tolerance} must be >= 0")
        if min_world_size < 1:
            raise ValueError(f"balancer.min_world_size={min_world_size} must be >= 1")
        if on_release not in ON_RELEASE:
            raise ValueError(f"balancer.on_release={on_release!r} is not one of {list(ON_RELEASE)}")
        self.every_n_steps = every_n_steps
        self.method = method
        self.min_gain = min_gain
        self.warmup_steps = warmup_steps
        self.profile_every_n_steps = profile_every_n_steps or max(1, every_n_steps // 5)
        self.smoothing = smoothing
        self.memory_capacity = memory_capacity
        self.p2p_seconds = p2p_seconds
        self.repack = repack
        self.repack_tolerance = repack_tolerance
        self.min_world_size = min_world_size
        self.on_release = on_release
        self._rng = random.Random(seed)
        self.tracker: CostTracker | None = None
        self.bandwidth = _DEFAULT_BANDWIDTH
        self.planned_once = False
        self.history: list[dict[str, Any]] = []
        self._restored: dict[str, Any] | None = None
        self._profiling = False
        self._last_measured: dict[int, dict[str, float]] | None = None
        self._bound: DynMoStrategy | None = None

    # ----------------------------------------------------------------------------------------------------------------
    def _strategy(self, trainer: pl.Trainer) -> DynMoStrategy:
        strategy = trainer.strategy
        if not isinstance(strategy, DynMoStrategy):
            raise TypeError(
                f"DynMoBalancer needs Trainer(strategy=DynMoStrategy(...)) (or strategy='dynmo'), got "
                f"{type(strategy).__name__}"
            )
        return strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._bound = self._strategy(trainer)
        if self.repack and self.min_world_size > self._bound.pp_size:
            raise ValueError(
                f"balancer.min_world_size={self.min_world_size} > the pipeline's {self._bound.pp_size} processes: "
                "lower it (or start more processes)"
            )
        if self.repack and self._bound.stages_per_rank != 1:
            raise ValueError("balancer.repack needs one stage per rank (strategy.stages_per_rank=1)")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if self.tracker is None or self.tracker.n_layers != strategy.n_layers:
            self.tracker = CostTracker(strategy.n_layers, self.smoothing)
        if self._restored is not None:
            self._resume(trainer, strategy, self._restored)
            self._restored = None

    def _resume(self, trainer: pl.Trainer, strategy: DynMoStrategy, state: dict[str, Any]) -> None:
        """Start a resumed run from the balanced split (re-planned when the number of stages changed)."""
        assert self.tracker is not None
        if state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])
        saved = state.get("partition")
        if saved is not None and len(saved) == strategy.n_stages:
            strategy.repartition(list(saved))
        elif self.tracker.samples and self.method != "random":
            strategy.repartition(self._plan(strategy)[0])

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        step = trainer.global_step
        done = self.method in ("static_time", "params") and self.planned_once
        self._profiling = (
            self.method != "random"
            and not done
            and step >= self.warmup_steps
            and ((step + 1) % self.profile_every_n_steps == 0 or (step + 1) % self.every_n_steps == 0)
        )
        if self._profiling:
            self._strategy(trainer).request_profile()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self._strategy(trainer)
        assert self.tracker is not None and strategy.runtime is not None
        if self._profiling:
            measured = strategy.profile_results()
            self.tracker.update(measured)
            self._last_measured = measured
            self._profiling = False
        step = trainer.global_step  # optimizer steps done, this one included
        if step % self.every_n_steps or step <= self.warmup_steps:
            return
        if self.method in ("static_time", "params") and self.planned_once:
            return
        if self.method != "random" and self.method != "params" and not self.tracker.samples:
            return
        self._check(trainer, pl_module, strategy)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: DynMoStrategy) -> None:
        assert self.tracker is not None
        t0 = time.perf_counter()
        proposed, info = self._plan(strategy)
        plan_s = time.perf_counter() - t0
        current = strategy.layers_per_stage
        migrate, saving = self._decide(strategy, current, proposed)
        # Decided once, by global rank 0, for every process of the job: the inputs agree (costs are gathered), but
        # the bandwidth estimate is each process's own timing, and a split decision would deadlock the migration.
        migrate, proposed, saving = strategy.broadcast((migrate, proposed, saving))
        self.planned_once = True
        migrate_s, moved = 0.0, 0
        if migrate and proposed != current:
            stats = strategy.repartition(proposed)
            migrate_s = stats.seconds
            moved = stats.bytes_sent + stats.bytes_received
            if moved and migrate_s > 0:
                self.bandwidth = 0.5 * self.bandwidth + 0.5 * (moved / migrate_s)
        record = {
            "step": trainer.global_step,
            "current": current,
            "proposed": proposed,
            "migrated": bool(migrate and proposed != current),
            "predicted_saving_s": saving,
            "plan_s": plan_s,
            "migrate_s": migrate_s,
            **info,
        }
        self.history.append(record)
        self._log(pl_module, strategy, record)
        if self.repack and strategy.pp_size > self.min_world_size and self.method != "random":
            self._consolidate(trainer, pl_module, strategy)

    def _consolidate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: DynMoStrategy) -> None:
        """Pack onto fewer processes when the cost model says the step time holds (released processes exit here)."""
        assert self.tracker is not None
        v = self.tracker.values
        memory = capacity = None
        if self.memory_capacity is not None:
            memory, capacity = self.tracker.memory(self._inflight(strategy)), self.memory_capacity
        plan = balance.plan_repack(
            v["fwd"],
            v["bwd"],
            strategy.layers_per_stage,
            n_microbatches=strategy.n_microbatches,
            schedule="gpipe" if strategy.schedule == "gpipe" else "1f1b",
            p2p=self.p2p_seconds,
            tolerance=self.repack_tolerance,
            min_stages=self.min_world_size,
            layer_bytes=[p + o for p, o in zip(v["param_bytes"], v["optim_bytes"], strict=True)],
            memory=memory,
            capacity=capacity,
        )
        plan = strategy.broadcast(plan)  # one decision for all replicas (see `_check`)
        if plan is None:
            return
        world_before = strategy.world_size
        self.history.append(
            {
                "step": trainer.global_step,
                "repack": plan.keep_ranks,
                "proposed": plan.layers_per_stage,
                "predicted_step_s": plan.step_time,
                "current_step_s": plan.current_step_time,
            }
        )
        stats = strategy.shrink(plan.keep_ranks, plan.layers_per_stage, on_release=self.on_release)
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

    def _plan(self, strategy: DynMoStrategy) -> tuple[list[int], dict[str, Any]]:
        """The partition ``method`` proposes for the current smoothed costs."""
        assert self.tracker is not None
        n_stages = strategy.n_stages
        if self.method == "random":
            cuts = sorted(self._rng.sample(range(1, strategy.n_layers), n_stages - 1))
            bounds = [0, *cuts, strategy.n_layers]
            return [b - a for a, b in itertools.pairwise(bounds)], {}
        if self.method == "params":
            return balance.partition(strategy.layer_param_counts, n_stages, method="params"), {}
        costs = self.tracker.compute
        memory = capacity = None
        if self.memory_capacity is not None:
            memory = self.tracker.memory(self._inflight(strategy))
            capacity = self.memory_capacity
        if self.method == "diffusion":
            result = balance.diffuse(costs, strategy.layers_per_stage, memory=memory, capacity=capacity)
            return result.layers_per_stage, {"diffusion_rounds": result.rounds}
        return balance.partition(costs, n_stages, method="optimal", memory=memory, capacity=capacity), {}

    def _inflight(self, strategy: DynMoStrategy) -> int:
        """Micro-batches whose activations a stage may hold at once under the schedule."""
        if strategy.schedule == "gpipe":
            return strategy.n_microbatches
        return min(strategy.n_microbatches, strategy.n_stages)

    def _decide(self, strategy: DynMoStrategy, current: list[int], proposed: list[int]) -> tuple[bool, float]:
        """Whether moving to ``proposed`` pays, by the pipeline cost model (``random`` and one-shot plans always go)."""
        if self.method in ("random", "params") or proposed == current:
            return proposed != current, 0.0
        assert self.tracker is not None
        v = self.tracker.values
        bytes_moved = 0.0
        for i in range(strategy.n_layers):
            if _owner(current, i, strategy.pp_size) != _owner(proposed, i, strategy.pp_size):
                bytes_moved += v["param_bytes"][i] + v["optim_bytes"][i]
        schedule = "gpipe" if strategy.schedule == "gpipe" else "1f1b"
        decision, saving = balance.should_repartition(
            v["fwd"],
            v["bwd"],
            current,
            proposed,
            n_microbatches=strategy.n_microbatches,
            schedule=schedule,
            p2p=self.p2p_seconds,
            steps_until_next_check=self.every_n_steps,
            migration_cost=bytes_moved / self.bandwidth,
            min_gain=self.min_gain if self.method != "static_time" else 0.0,
        )
        return decision, saving

    def _log(self, pl_module: pl.LightningModule, strategy: DynMoStrategy, record: dict[str, Any]) -> None:
        assert self.tracker is not None
        costs = self.tracker.compute
        predicted = balance.stage_loads(costs, strategy.layers_per_stage)
        metrics = {
            "balancer/migrated": float(record["migrated"]),
            "balancer/plan_ms": 1e3 * record["plan_s"],
            "balancer/migrate_ms": 1e3 * record["migrate_s"],
            "balancer/imbalance_predicted": _imbalance(predicted),
        }
        if self._last_measured is not None:
            measured_costs = [self._last_measured[i]["fwd"] + self._last_measured[i]["bwd"] for i in range(len(costs))]
            measured = balance.stage_loads(measured_costs, record["current"])
            metrics["balancer/imbalance_measured"] = _imbalance(measured)
            for s, load in enumerate(measured):
                metrics[f"balancer/stage{s}_load_measured_ms"] = 1e3 * load
        for s, (load, n) in enumerate(zip(predicted, strategy.layers_per_stage, strict=True)):
            metrics[f"balancer/stage{s}_load_predicted_ms"] = 1e3 * load
            metrics[f"balancer/stage{s}_layers"] = float(n)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "tracker": self.tracker.state_dict() if self.tracker is not None else None,
            "partition": self._bound.layers_per_stage if self._bound is not None else None,
            "bandwidth": self.bandwidth,
            "planned_once": self.planned_once,
            "rng": self._rng.getstate(),
            "history": self.history,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bandwidth = float(state_dict.get("bandwidth", _DEFAULT_BANDWIDTH))
        self.planned_once = bool(state_dict.get("planned_once", False))
        if state_dict.get("rng") is not None:
            self._rng.setstate(_as_rng_state(state_dict["rng"]))
        self.history = list(state_dict.get("history", []))
        self._restored = state_dict


def _owner(layers_per_stage: list[int], index: int, n_ranks: int) -> int:
    end = 0
    for stage, n in enumerate(layers_per_stage):
        end += n
        if index < end:
            return stage % n_ranks
    raise IndexError(index)


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _as_rng_state(state: Any) -> tuple:
    """``random.Random.getstate()`` comes back from a checkpoint with lists instead of tuples."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
