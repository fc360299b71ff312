"""Replay a cost trace under a balancing policy: step times, migrations, consolidation and rank-seconds.

Every step of the trace runs through :func:`~dynmo_lightning.sim.simulator.simulate_layers` under the partition in
force. The dynamic policies replay the balancer's own decision code: a :class:`~dynmo_lightning.balance.decision.policy.
BalancePolicy` (the object :class:`~dynmo_lightning.callbacks.DynMoBalancer` drives) sees the steps it would have
profiled (:meth:`~dynmo_lightning.balance.decision.policy.BalancePolicy.wants_profile`; every step by default), and at
every step where a check is due (:meth:`~dynmo_lightning.balance.decision.policy.BalancePolicy.due`, before step ``k``
once ``k`` steps are done) it decides from the costs of the steps before ``k`` (never the future) whether to keep the
split, migrate, or repack. A migration costs the bytes of the layers that change owner (``param_bytes`` plus
``optim_bytes`` when the trace has them) over ``bandwidth``, plus ``migration_overhead``; every rank of the pipeline is
charged for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dynmo_lightning import balance
from dynmo_lightning.balance.decision.policy import GROW, MIGRATE, REPACK, BalancePolicy, PipelineShape
from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.sim.simulator import simulate_layers
from dynmo_lightning.sim.traces import check_trace

#: Policies of :func:`simulate_run`: two static splits and the balancer's methods (``"optimal+repack"`` is
#: ``"optimal"`` with consolidation).
POLICIES = ("uniform", "params", "static_time", "optimal", "diffusion", "optimal+repack")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A replayed run.

    Attributes:
        policy: the policy replayed.
        steps: the trace's step numbers.
        step_times: simulated time of each step.
        migration_times: seconds spent migrating (re-partition and consolidation) just before each step.
        partitions: ``(step, layers_per_stage)`` at the start and after every change, in order.
        world_sizes: ``(step, ranks)`` at the start and after every consolidation.
        imbalance: per step, the largest stage load (forward plus backward) over the mean one (1 is perfect).
        rank_seconds: sum over steps and migrations of the ranks in use times the time taken.
        bytes_moved: bytes sent by all migrations.
    """

    policy: str
    steps: list[int]
    step_times: list[float]
    migration_times: list[float]
    partitions: list[tuple[int, list[int]]]
    world_sizes: list[tuple[int, int]]
    imbalance: list[float]
    rank_seconds: float
    bytes_moved: float

    @property
    def total_time(self) -> float:
        """Wall time of the whole run: every step plus every migration."""
        return math.fsum(self.step_times) + math.fsum(self.migration_times)

    @property
    def n_migrations(self) -> int:
        """Partition changes after the start (consolidations included)."""
        return len(self.partitions) - 1

    def speedup_over(self, baseline: RunResult) -> float:
        """How many times faster this run finishes than ``baseline`` (``baseline.total_time / total_time``)."""
        return baseline.total_time / self.total_time if self.total_time > 0 else math.inf

    def rank_seconds_saved(self, baseline: RunResult) -> float:
        """Share of ``baseline``'s rank-seconds this run does without (0.25: a quarter fewer)."""
        return 1.0 - self.rank_seconds / baseline.rank_seconds if baseline.rank_seconds > 0 else 0.0


def simulate_run(
    trace: Iterable[Mapping[str, Any]],
    policy: str,
    n_stages: int,
    *,
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    every_n_steps: int = 10,
    bandwidth: float = 10e9,
    repack: bool = False,
    regrow: bool = False,
    profile_every_n_steps: int = 1,
    warmup_steps: int = 0,
    stages_per_rank: int = 1,
    speeds: Callable[[int], Sequence[float]] | None = None,
    **settings: Any,
) -> RunResult:
    """Replay a cost trace under one balancing policy.

    Policies (:data:`POLICIES`):

    * ``"uniform"``: layers split by count, never changed;
    * ``"params"``: optimal split of the first step's ``param_bytes``, never changed (DeepSpeed's start);
    * ``"static_time"``, ``"optimal"``, ``"diffusion"``: the balancer with that method, starting uniform
      (``static_time`` plans once, at the first check);
    * ``"optimal+repack"``: ``"optimal"`` with ``repack=True``.

    Args:
        trace: steps as in :mod:`~dynmo_lightning.sim.traces` (e.g. from :func:`load_trace`).
        policy: one of :data:`POLICIES`.
        n_stages: pipeline stages at the start (``stages_per_rank`` of them on each rank).
        n_microbatches: micro-batches per step.
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES` (its task order times every
            step and every decision).
        p2p: one-hop transfer time, in the trace's time unit.
        every_n_steps: steps between checks of the dynamic policies.
        bandwidth: bytes per time unit a migration moves.
        repack: consolidate onto fewer ranks when :func:`balance.plan_repack` finds a split within the
            ``repack_tolerance`` (released ranks stop counting).
        regrow: released ranks wait to come back (``PipelineShape.waiting``): the policy grows the pipeline again
            when the full one is more than ``repack_tolerance`` faster (re-admitted ranks count again).
        profile_every_n_steps: the balancer's profiling interval (which trace steps the policy sees).
        warmup_steps: the balancer's warm-up (no profiles, no checks before it).
        stages_per_rank: stages each rank runs (interleaved and V schedules; placement by
            :func:`~dynmo_lightning.balance.split.placement.stage_ranks`); rank-seconds count ranks, not stages.
        speeds: ``speeds(k)`` is the relative speed of every process of the starting pipeline during trace step
            ``k`` (a straggler: one below 1); ``None``: all 1. A process of speed ``v`` takes its layers' trace costs
            over ``v``; the policy sees what the balancer would: each layer's time on its process with that
            process's calibration kernel time (``1 / v``), and plans with the speeds it estimates from them. A
            consolidation keeps processes by the ranks it keeps.
        **settings: further settings of :class:`~dynmo_lightning.balance.decision.policy.BalancePolicy` (``min_gain``,
            ``smoothing``, ``window``, ``migration_overhead``, ``repack_tolerance``, ``min_stages``, ...).

    Returns:
        The :class:`RunResult`.

    Raises:
        ValueError: for an unknown policy, ``params`` without ``param_bytes``, ``repack`` with a policy that never
            re-plans, a bad balancer setting, and as :func:`~dynmo_lightning.sim.simulator.simulate` does.
    """
    policy, repack = _check_policy(policy, repack, n_stages, stages_per_rank)
    steps = check_trace(trace)
    balancer = None
    if policy not in ("uniform", "params"):
        cadence = {"every_n_steps": every_n_steps, "profile_every_n_steps": profile_every_n_steps}
        link = {"p2p_seconds": p2p, "bandwidth": bandwidth}
        balancer = BalancePolicy(policy, warmup_steps=warmup_steps, repack=repack, **link, **cadence, **settings)
        balancer.start(len(steps[0]["fwd"]))
    run = _Recorder(steps[0]["step"], _initial(steps[0], policy, n_stages), stages_per_rank)
    simulated: dict[tuple[Any, ...], float] = {}  # traces hold long runs of equal costs: simulate each split once
    for k, entry in enumerate(steps):
        if balancer is not None:
            _check(balancer, k, entry, run, n_microbatches, schedule, n_stages if regrow else 0)
        if speeds is not None:  # under the split the check left in force
            entry = _on_processes(entry, run, [float(v) for v in speeds(k)], schedule)
        if balancer is not None:
            _profile(balancer, k, entry)
        _run_step(entry, run, simulated, n_microbatches, schedule, p2p)
    return run.result(policy if not repack else f"{policy}+repack")


def _run_step(
    entry: Mapping[str, Any],
    run: _Recorder,
    simulated: dict[tuple[Any, ...], float],
    n_microbatches: int,
    schedule: str,
    p2p: float,
) -> None:
    """Time one trace step under the split in force (each distinct split and costs simulated once) and record it."""
    key = (*run.current, *entry["fwd"], *entry["bwd"], *entry.get("bwd_weight", ()))
    if key not in simulated:
        fwd, bwd, wgt = entry["fwd"], entry["bwd"], entry.get("bwd_weight")
        simulated[key] = simulate_layers(
            fwd, bwd, run.current, n_microbatches, schedule, p2p, layer_wgt=wgt, stages_per_rank=run.stages_per_rank
        ).step_time
    loads = balance.stage_loads([f + b for f, b in zip(entry["fwd"], entry["bwd"], strict=True)], run.current)
    run.step(entry["step"], simulated[key], balance.imbalance(loads))


def _check_policy(policy: str, repack: bool, n_stages: int, stages_per_rank: int) -> tuple[str, bool]:
    """The policy's method and whether it repacks (``"optimal+repack"`` is both); refuses what cannot replay."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    if policy == "optimal+repack":
        policy, repack = "optimal", True
    if repack and policy not in ("optimal", "diffusion"):
        raise ValueError(f"repack=True needs a policy that re-plans (optimal, diffusion), not {policy!r}")
    if stages_per_rank < 1 or n_stages % stages_per_rank or (repack and stages_per_rank > 1):
        raise ValueError(
            f"n_stages={n_stages} with stages_per_rank={stages_per_rank}: the stages must fill every rank equally, "
            "and consolidation (repack) runs with one stage per rank, as the balancer does"
        )
    return policy, repack


def _check(
    balancer: BalancePolicy,
    k: int,
    entry: Mapping[str, Any],
    run: _Recorder,
    n_microbatches: int,
    schedule: str,
    full_stages: int = 0,
) -> None:
    """What the balancer does before step ``k``: check, and replay its decisions.

    With ``full_stages``, the ranks released below it wait to be re-admitted.
    """
    if balancer.due(k):
        waiting = max(0, full_stages - len(run.current))
        pipe = PipelineShape(run.current, run.ranks, n_microbatches, schedule, waiting=waiting)
        for decision in balancer.decide(pipe):
            if decision.action in (MIGRATE, REPACK, GROW):
                run.migrate(entry["step"], decision.proposed, decision.bytes_moved, decision.migration_s,
                            decision.keep_ranks if decision.action == REPACK else None)  # fmt: skip
                balancer.carried_out(decision)


def _profile(balancer: BalancePolicy, k: int, entry: Mapping[str, Any]) -> None:
    """What the balancer does around step ``k`` as it runs: its events, and its profile when it wants one.

    A trace step's ``changed_layers`` (layers a dynamic changed just before it) are the balancer's events.
    """
    if entry.get("changed_layers"):
        balancer.layers_changed(entry["changed_layers"])
    if balancer.wants_profile(k):
        fields = [f for f in (*balance.CostTracker.FIELDS, "probe_s", "pp_rank") if f in entry]
        balancer.observe({i: {f: entry[f][i] for f in fields} for i in range(len(entry["fwd"]))})


class _Recorder:
    """Accumulates what :func:`simulate_run` reports."""

    def __init__(self, step: int, layers_per_stage: list[int], stages_per_rank: int = 1) -> None:
        self.current = list(layers_per_stage)
        self.stages_per_rank = stages_per_rank
        self.steps: list[int] = []
        self.step_times: list[float] = []
        self.migration_times: list[float] = []
        self.imbalance: list[float] = []
        self.partitions = [(step, list(layers_per_stage))]
        self.world_sizes = [(step, len(layers_per_stage) // stages_per_rank)]
        self.rank_seconds = 0.0
        self.bytes_moved = 0.0
        self._pending = 0.0  # migration time charged to the next step
        #: The processes (by their rank in the starting pipeline) that run the pipeline's ranks now, in order.
        self.processes = list(range(self.ranks))

    def migrate(
        self, step: int, layers_per_stage: list[int], moved: float, seconds: float, keep: list[int] | None = None
    ) -> None:
        """A move to ``layers_per_stage`` before ``step`` (fewer stages: a consolidation onto ``keep``, more: a grow).

        Re-admitted processes are those released, in their starting order.
        """
        if keep is not None:
            self.processes = [self.processes[r] for r in keep]
        elif len(layers_per_stage) > len(self.current):
            released = [p for p in range(self.world_sizes[0][1]) if p not in self.processes]
            self.processes += released[: len(layers_per_stage) // self.stages_per_rank - self.ranks]
        self.partitions.append((step, list(layers_per_stage)))
        self.bytes_moved += moved
        self._pending += seconds
        self.rank_seconds += self.ranks * seconds  # every rank of the pipeline waits for a migration
        if len(layers_per_stage) != len(self.current):
            self.world_sizes.append((step, len(layers_per_stage) // self.stages_per_rank))
        self.current = list(layers_per_stage)

    def step(self, step: int, seconds: float, imbalance: float) -> None:
        self.steps.append(step)
        self.step_times.append(seconds)
        self.migration_times.append(self._pending)
        self.imbalance.append(imbalance)
        self.rank_seconds += self.ranks * seconds
        self._pending = 0.0

    @property
    def ranks(self) -> int:
        """Processes of the pipeline in force."""
        return len(self.current) // self.stages_per_rank

    def result(self, policy: str) -> RunResult:
        return RunResult(
            policy,
            self.steps,
            self.step_times,
            self.migration_times,
            self.partitions,
            self.world_sizes,
            self.imbalance,
            self.rank_seconds,
            self.bytes_moved,
        )


def _on_processes(entry: Mapping[str, Any], run: _Recorder, speeds: list[float], schedule: str) -> dict[str, Any]:
    """A trace step as it runs on processes of ``speeds``: each layer's times over its process's speed.

    Beside them, what the balancer's profile carries: its process's calibration kernel time ``1 / v`` and its
    pipeline rank.
    """
    ranks = stage_ranks(schedule, run.ranks, run.stages_per_rank)
    owner = [ranks[s] for s, n in enumerate(run.current) for _ in range(n)]
    rate = [speeds[run.processes[r]] for r in owner]
    out = dict(entry)
    for field in ("fwd", "bwd", "bwd_weight"):
        if field in entry:
            out[field] = [t / v for t, v in zip(entry[field], rate, strict=True)]
    out["probe_s"] = [1.0 / v for v in rate]
    out["pp_rank"] = [float(r) for r in owner]
    return out


def _initial(first: Mapping[str, Any], policy: str, n_stages: int) -> list[int]:
    """The split a policy starts from (the dynamic ones start uniform: nothing is measured yet)."""
    if policy == "params":
        if "param_bytes" not in first:
            raise ValueError("policy 'params' needs 'param_bytes' in the trace")
        return balance.partition(first["param_bytes"], n_stages, method="params")
    return balance.partition(first["fwd"], n_stages, method="uniform")
