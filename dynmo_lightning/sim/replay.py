"""Replay a cost trace under a balancing policy: step times, migrations, consolidation and rank-seconds.

Every step of the trace runs through :func:`~dynmo_lightning.sim.simulator.simulate_layers` under the partition in
force. Dynamic policies decide the way :class:`~dynmo_lightning.callbacks.DynMoBalancer` does: every step's measured
costs go into the balancer's :class:`~dynmo_lightning.balance.CostTracker` (same smoothing and median window); at each
check (before step ``k`` whenever ``k`` is a positive multiple of ``every_n_steps``) they see the smoothed costs of
steps up to ``k - 1`` (never the future), plan with :mod:`dynmo_lightning.balance`, migrate when
:func:`~dynmo_lightning.balance.should_repartition` says the saving until the next check beats the migration, then
optionally consolidate with :func:`~dynmo_lightning.balance.plan_repack`. A migration costs the bytes of the layers
that change owner (``param_bytes`` plus ``optim_bytes`` when the trace has them) over ``bandwidth``, plus
``migration_overhead``; every rank of the pipeline is charged for it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dynmo_lightning import balance
from dynmo_lightning.sim.simulator import simulate_layers
from dynmo_lightning.sim.traces import check_trace

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
    migration_overhead: float = 0.0,
    min_gain: float = 0.05,
    smoothing: float = 0.5,
    window: int = 5,
    repack: bool = False,
    repack_tolerance: float = 0.05,
    min_stages: int = 1,
) -> RunResult:
    """Replay a cost trace under one balancing policy.

    Policies (:data:`POLICIES`):

    * ``"uniform"``: layers split by count, never changed;
    * ``"params"``: optimal split of the first step's ``param_bytes``, never changed;
    * ``"static_time"``: optimal split of the first step's times, never changed;
    * ``"optimal"``: starts uniform; each check re-plans optimally from the latest measured costs;
    * ``"diffusion"``: the same cadence with :func:`balance.diffuse` from the split in force;
    * ``"optimal+repack"``: ``"optimal"`` with ``repack=True``.

    Args:
        trace: steps as in :mod:`~dynmo_lightning.sim.traces` (e.g. from :func:`load_trace`).
        policy: one of :data:`POLICIES`.
        n_stages: pipeline stages (one rank each) at the start.
        n_microbatches: micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        p2p: one-hop transfer time, in the trace's time unit.
        every_n_steps: steps between checks of the dynamic policies.
        bandwidth: bytes per time unit a migration moves.
        migration_overhead: fixed time added to each migration (rebuilding stages and schedules).
        min_gain: smallest relative step-time gain worth migrating for (as :func:`balance.should_repartition`;
            the balancer's default).
        smoothing: weight of a new measurement in the cost averages (the balancer's ``smoothing``).
        window: measurements per layer the median is taken over (see :class:`balance.CostTracker`).
        repack: after each check of a dynamic policy, consolidate onto fewer ranks when
            :func:`balance.plan_repack` finds a split within ``repack_tolerance``; released ranks stop counting.
        repack_tolerance: accepted relative slow-down of a consolidation.
        min_stages: never consolidate below this many ranks.

    Returns:
        The :class:`RunResult`.

    Raises:
        ValueError: for an unknown policy, ``params`` without ``param_bytes`` in the trace, ``repack`` with a
            policy that never re-plans, a non-positive ``every_n_steps`` or ``bandwidth``, and as the planners and
            :func:`~dynmo_lightning.sim.simulator.simulate` do.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    if policy == "optimal+repack":
        policy, repack = "optimal", True
    dynamic = policy in ("optimal", "diffusion")
    if repack and not dynamic:
        raise ValueError(f"repack=True needs a policy that re-plans (optimal, diffusion), not {policy!r}")
    if every_n_steps < 1:
        raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps!r}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes per time unit, got {bandwidth!r}")
    steps = check_trace(trace)
    n_layers = len(steps[0]["fwd"])
    current = _initial(steps[0], policy, n_stages)
    world = len(current)
    plan_args = {"n_microbatches": n_microbatches, "schedule": schedule, "p2p": p2p}
    run = _Recorder(steps[0]["step"], current, world)
    tracker = balance.CostTracker(n_layers, smoothing, window)
    for k, entry in enumerate(steps):
        if dynamic and k and k % every_n_steps == 0:
            v = tracker.values
            fwd, bwd, layer_bytes = v["fwd"], v["bwd"], _layer_bytes(v, n_layers)
            costs = tracker.compute
            if policy == "optimal":
                proposed = balance.partition(costs, world, method="optimal")
            else:
                proposed = balance.diffuse(costs, current).layers_per_stage
            if proposed != current:
                moved = _bytes_moved(current, proposed, layer_bytes)
                seconds = moved / bandwidth + migration_overhead
                go, _ = balance.should_repartition(
                    fwd,
                    bwd,
                    current,
                    proposed,
                    **plan_args,
                    steps_until_next_check=every_n_steps,
                    migration_cost=seconds,
                    min_gain=min_gain,
                )
                if go:
                    current = proposed
                    run.migrate(entry["step"], current, world, moved, seconds)
            if repack and world > min_stages:
                plan = balance.plan_repack(
                    fwd,
                    bwd,
                    current,
                    **plan_args,
                    tolerance=repack_tolerance,
                    min_stages=min_stages,
                    layer_bytes=layer_bytes,
                )
                if plan is not None:
                    seconds = plan.bytes_moved / bandwidth + migration_overhead
                    run.migrate(entry["step"], plan.layers_per_stage, world, plan.bytes_moved, seconds)
                    current, world = plan.layers_per_stage, plan.n_stages
                    run.world_sizes.append((entry["step"], world))
        tracker.update({i: {f: entry[f][i] for f in tracker.FIELDS if f in entry} for i in range(n_layers)})
        step_time = simulate_layers(entry["fwd"], entry["bwd"], current, **plan_args).step_time
        loads = balance.stage_loads([f + b for f, b in zip(entry["fwd"], entry["bwd"], strict=True)], current)
        run.step(entry["step"], step_time, world, _imbalance(loads))
    return run.result(policy if not repack else f"{policy}+repack")


class _Recorder:
    """Accumulates what :func:`simulate_run` reports."""

    def __init__(self, step: int, layers_per_stage: list[int], world: int) -> None:
        self.steps: list[int] = []
        self.step_times: list[float] = []
        self.migration_times: list[float] = []
        self.imbalance: list[float] = []
        self.partitions = [(step, list(layers_per_stage))]
        self.world_sizes = [(step, world)]
        self.rank_seconds = 0.0
        self.bytes_moved = 0.0
        self._pending = 0.0  # migration time charged to the next step

    def migrate(self, step: int, layers_per_stage: list[int], world: int, moved: float, seconds: float) -> None:
        self.partitions.append((step, list(layers_per_stage)))
        self.bytes_moved += moved
        self._pending += seconds
        self.rank_seconds += world * seconds

    def step(self, step: int, seconds: float, world: int, imbalance: float) -> None:
        self.steps.append(step)
        self.step_times.append(seconds)
        self.migration_times.append(self._pending)
        self.imbalance.append(imbalance)
        self.rank_seconds += world * seconds
        self._pending = 0.0

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


def _initial(first: Mapping[str, Any], policy: str, n_stages: int) -> list[int]:
    """The split a policy starts from (the dynamic ones start uniform: nothing is measured yet)."""
    if policy == "params":
        if "param_bytes" not in first:
            raise ValueError("policy 'params' needs 'param_bytes' in the trace")
        return balance.partition(first["param_bytes"], n_stages, method="params")
    if policy == "static_time":
        costs = [f + b for f, b in zip(first["fwd"], first["bwd"], strict=True)]
        return balance.partition(costs, n_stages, method="static_time")
    return balance.partition(first["fwd"], n_stages, method="uniform")


def _layer_bytes(entry: Mapping[str, Any], n_layers: int) -> list[float]:
    """Bytes that move with each layer: parameters plus optimizer state, as the balancer counts them."""
    zeros = [0.0] * n_layers
    params, optim = entry.get("param_bytes", zeros), entry.get("optim_bytes", zeros)
    return [p + o for p, o in zip(params, optim, strict=True)]


def _bytes_moved(current: Sequence[int], proposed: Sequence[int], layer_bytes: Sequence[float]) -> float:
    """Bytes of the layers whose stage changes between two splits over the same ranks."""
    owner_now = [s for s, n in enumerate(current) for _ in range(n)]
    owner_new = [s for s, n in enumerate(proposed) for _ in range(n)]
    return math.fsum(b for b, x, y in zip(layer_bytes, owner_now, owner_new, strict=True) if x != y)


def _imbalance(loads: Sequence[float]) -> float:
    mean = math.fsum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
