"""One decision code for the balancer and the simulator: the same trace gives the same decisions in both."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.balance import BalancePolicy, PipelineShape, bytes_moved, imbalance, layer_owners
from dynmo_lightning.balance.diffusion.driver import drive
from dynmo_lightning.pipeline.stage.migration import MigrationStats
from dynmo_lightning.pipeline.stage.neighbours import NeighbourStats
from dynmo_lightning.protocol import (
    LayerEvents,
    PipelineControl,
    Rebalancing,
    RunFacts,
    layer_editing,
    pipeline_control,
)
from dynmo_lightning.sim import simulate_run

LAYER_BYTES = 4e7


def dynamic_trace(n_steps: int = 120, n_layers: int = 16) -> list[dict[str, Any]]:
    """Layers whose costs change twice: a frozen prefix from step 30, a cheaper tail from step 70 (pruning)."""
    trace = []
    for step in range(n_steps):
        fwd, bwd = [0.010] * n_layers, [0.020] * n_layers
        fwd[-1], bwd[-1] = 0.030, 0.060
        if step >= 30:
            bwd[:6] = [0.0] * 6
        if step >= 70:
            for i in range(10, n_layers - 1):
                fwd[i], bwd[i] = 0.004, 0.008
        param = [LAYER_BYTES] * n_layers
        entry = {"step": step, "fwd": fwd, "bwd": bwd, "param_bytes": param, "optim_bytes": [0.0] * n_layers}
        # the dynamics' events: what changed just before this step
        entry["changed_layers"] = list(range(6)) if step == 30 else list(range(10, n_layers - 1)) if step == 70 else []
        trace.append(entry)
    return trace


@dataclasses.dataclass
class _Trainer:
    strategy: Any
    global_step: int = 0


class _Module:
    def log_dict(self, *args: Any, **kwargs: Any) -> None:
        pass


class TraceStrategy:
    """A pipeline whose profiles come from a recorded trace and whose moves only change the split (no processes).

    It implements :class:`PipelineControl`, the whole contract a callback may use, so the balancer runs its real
    code path: cadence, profiling requests, the decision, the broadcast, repartition and shrink calls.
    """

    n_microbatches = 8
    schedule = "1f1b"
    stages_per_rank = 1
    data_parallel = "ddp"
    tensor_parallel_size = 1
    fsdp_memory = "fast"
    fsdp_memory_in_force = "fast"

    def __init__(self, trace: list[dict[str, Any]], n_stages: int, bandwidth: float) -> None:
        self.trace, self.bandwidth = trace, bandwidth
        n_layers = len(trace[0]["fwd"])
        self._split = [n_layers // n_stages] * n_stages
        self.partitions: list[dict[str, Any]] = [{"step": 0, "layers_per_stage": list(self._split)}]
        self.step = 0
        self._requested = False

    world_size = property(lambda self: len(self._split))
    n_layers = property(lambda self: len(self.trace[0]["fwd"]))
    n_stages = property(lambda self: len(self._split))
    pp_size = property(lambda self: len(self._split))
    dp_size = property(lambda self: 1)
    layers_per_stage = property(lambda self: list(self._split))
    layer_param_counts = property(lambda self: [1] * self.n_layers)
    replica_ranks = property(lambda self: [list(range(len(self._split)))])
    host_group = property(lambda self: None)
    pipeline_nodes = property(lambda self: None)
    waiting = property(lambda self: 0)
    releases: list[dict[str, Any]] = []

    def request_profile(self) -> None:
        self._requested = True

    def profile_results(self) -> dict[int, dict[str, float]] | None:
        if not self._requested:
            return None
        self._requested = False
        entry = self.trace[self.step]
        fields = [k for k in entry if k not in ("step", "changed_layers")]
        return {i: {f: entry[f][i] for f in fields} for i in range(self.n_layers)}

    def _move(self, new: list[int], step: int) -> MigrationStats:
        moved = bytes_moved(self._split, new, [LAYER_BYTES] * self.n_layers)
        self._split = list(new)
        self.partitions.append({"step": step, "layers_per_stage": list(new)})
        return MigrationStats(moves=[], bytes_sent=int(moved), seconds=moved / self.bandwidth)

    def repartition(self, layers_per_stage: list[int]) -> MigrationStats:
        return self._move(layers_per_stage, self.step + 1)

    def shrink(
        self, keep_ranks: list[int], layers_per_stage: list[int], *, on_release: str = "exit", release_to: Any = None
    ) -> Any:
        return self._move(layers_per_stage, self.step + 1)

    def grow(self, layers_per_stage: list[int]) -> Any:
        raise AssertionError("nothing waits: no grow")

    def set_fsdp_memory(self, way: str) -> None:
        raise AssertionError("no FSDP2 units: the way never changes")

    def on_layers_changed(self, layers: list[int] | None = None) -> None:
        pass

    def changed_layers(self, step: int) -> list[int]:
        return list(self.trace[step]["changed_layers"]) if step < len(self.trace) else []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def run_neighbours(self, stage_of: Any) -> NeighbourStats:
        """All stages in this one process, cards passed in memory (the runtime sends them point-to-point)."""
        stages = [stage_of(s) for s in range(len(self._split))]
        rounds = sum(1 for _ in drive(stages))
        assert stages[0].outcome is not None
        return NeighbourStats(stages[0].outcome, rounds, stages[0].probes, 0, 0.0)

    def tie_layers(self, param: Any) -> set[int]:
        return set()

    def param_norm(self) -> float:
        return 0.0

    def replicas_in_sync(self) -> bool:
        return True

    def shard_sum(self, values: Any) -> Any:
        return values


def _run_balancer(trace, n_stages, bandwidth, **kwargs) -> list[tuple[int, list[int]]]:
    """Drive the real callback hook by hook, as the fit loop would, over the trace's steps."""
    strategy = TraceStrategy(trace, n_stages, bandwidth)
    assert isinstance(strategy, PipelineControl)
    balancer = DynMoBalancer(**kwargs)
    trainer, module = _Trainer(strategy), _Module()
    balancer.setup(trainer, module, "fit")
    balancer.on_train_start(trainer, module)
    for step in range(len(trace)):
        strategy.step = trainer.global_step = step
        balancer.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # the optimizer step of `step` is done
        balancer.on_train_batch_end(trainer, module, None, None, step)
    return [(p["step"], p["layers_per_stage"]) for p in strategy.partitions]


@pytest.mark.parametrize(
    ("method", "settings"),
    [
        ("optimal", {}),
        ("optimal", {"react_samples": 0}),  # no reaction to events: the regular checks only
        ("optimal", {"profile_every_n_steps": 3, "warmup_steps": 4}),
        ("diffusion", {}),
        ("diffusion", {"diffusion_mode": "sweep"}),
        ("static_time", {}),
        ("optimal", {"repack": True, "repack_tolerance": 0.10}),
    ],
)
def test_balancer_and_simulator_make_the_same_decisions(method, settings):
    trace, bandwidth = dynamic_trace(), 2e9
    kwargs = {"every_n_steps": 10, "min_gain": 0.02, "warmup_steps": 0, "profile_every_n_steps": 1, **settings}
    got = _run_balancer(trace, 4, bandwidth, method=method, **kwargs)
    sim_kwargs = {k: v for k, v in kwargs.items() if k != "repack_tolerance"}
    if "repack_tolerance" in settings:
        sim_kwargs["repack_tolerance"] = settings["repack_tolerance"]
    replay = simulate_run(trace, method, 4, n_microbatches=8, bandwidth=bandwidth, **sim_kwargs)
    assert got == [(s, list(p)) for s, p in replay.partitions]
    assert len(got) >= 2  # the trace's events made the balancer move (the comparison is not vacuous)


def test_strategy_gives_every_role_of_the_callback_contract():
    strategy = DynMoStrategy()
    trainer = SimpleNamespace(strategy=strategy)
    for role in (RunFacts, LayerEvents, Rebalancing, PipelineControl):
        assert pipeline_control(trainer, role) is strategy.pipeline_control
    assert not isinstance(strategy, RunFacts)  # the Lightning face is not a facade of the roles
    assert layer_editing(trainer) is None  # before set-up there are no layers to edit
    # a stand-in may be a role itself: the balancer's trace strategy is every role, a bare object none
    assert pipeline_control(SimpleNamespace(strategy=object()), RunFacts) is None


def test_one_shot_methods_plan_once_and_profile_no_more():
    policy = BalancePolicy("static_time", every_n_steps=5, profile_every_n_steps=1, warmup_steps=0)
    policy.start(4)
    for step in range(5):
        assert policy.wants_profile(step)
        policy.observe({i: {"fwd": 1.0 + 4 * (i == 0), "bwd": 0.0} for i in range(4)})
    assert policy.due(5)
    decisions = policy.decide(PipelineShape([2, 2], 2, 4))
    assert decisions[0].action == "migrate" and decisions[0].proposed != [2, 2]
    assert policy.done and not policy.wants_profile(6) and not policy.due(10)


def test_migration_must_pay_for_itself():
    policy = BalancePolicy("optimal", every_n_steps=10, bandwidth=1.0)  # 1 byte/s: moving never pays
    policy.start(4)
    policy.observe({i: {"fwd": 1.0 + 3 * (i == 0), "bwd": 0.0, "param_bytes": 100.0} for i in range(4)})
    (decision,) = policy.decide(PipelineShape([2, 2], 2, 4))
    assert decision.action == "keep" and decision.proposed == [1, 3] and decision.bytes_moved == 100.0
    assert decision.migration_s == 100.0 and decision.predicted_step_s < decision.current_step_s


def test_shared_measures():
    assert imbalance([1.0, 3.0]) == 1.5 and imbalance([0.0, 0.0]) == 1.0
    assert layer_owners([2, 1, 1, 2], 2) == [0, 0, 1, 0, 1, 1]
    assert layer_owners([2, 1, 1, 2], 2, "zbv") == [0, 0, 1, 1, 0, 0]  # the V: stages 0 and 3 on rank 0
    assert bytes_moved([2, 1, 1, 2], [1, 2, 2, 1], [1.0] * 6, 2, "zbv") == 2.0  # layers 1 and 4 change rank
    assert bytes_moved([2, 2], [1, 3], [1.0, 2.0, 4.0, 8.0]) == 2.0


def test_the_balancer_reacts_to_dynamics_events_within_a_few_steps():
    trace, bandwidth = dynamic_trace(), 2e9
    kwargs = {"every_n_steps": 20, "min_gain": 0.02, "warmup_steps": 0, "profile_every_n_steps": 5}
    reacting = _run_balancer(trace, 4, bandwidth, method="optimal", **kwargs)
    waiting = _run_balancer(trace, 4, bandwidth, method="optimal", react_samples=0, **kwargs)
    # The prefix freezes just before step 30: the reacting balancer moves 3 profiled steps later (before step 33).
    # Without reacting, the check at step 40 still plans from a median of mostly stale samples (profiles every 5
    # steps): it moves only at step 60, 30 steps late (and, planning from stale medians again after the second
    # event, twice more before it settles on the reacting balancer's split).
    assert [step for step, _ in reacting] == [0, 20, 33, 73]
    assert [step for step, _ in waiting] == [0, 20, 60, 80, 100]
    assert waiting[-1][1] == reacting[-1][1]
