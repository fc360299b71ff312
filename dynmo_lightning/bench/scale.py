"""Pipelines of many stages, simulated from realistic cost traces: DynMo against static splits and the oracle.

Every policy replays the trace through :func:`~dynmo_lightning.sim.simulate_run` - the balancer's own decision code
(:class:`~dynmo_lightning.balance.BalancePolicy`), with migrations charged at a migration bandwidth and activations
sent between stages at a point-to-point bandwidth and latency. The **oracle** is the most any balancer could get: at
every step the optimal split of that step's costs, moved to for free. Reported per policy: total time, speed-up over
the uniform split (Megatron-LM's), the share of the oracle's speed-up reached, migrations and bytes moved. The
oracle's split is the makespan-optimal one (:func:`~dynmo_lightning.balance.steptime.planner.makespan_split`), the
policy's too: both plan for the schedule's own task order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from dynmo_lightning.balance.steptime.planner import StepModel, makespan_split
from dynmo_lightning.sim import simulate_run

#: End-to-end speed-ups the DynMo paper reports over static Megatron-LM / DeepSpeed splits.
SEED = {"moe": 1.23, "pruning": 3.18, "freezing": 2.23, "sparse_attention": 4.02, "early_exit": 4.52, "mod": 1.17}
#: Policies replayed at scale: the two static splits, the one-shot profile, and DynMo's methods (with consolidation).
POLICIES = ("uniform", "params", "static_time", "optimal", "diffusion", "optimal+repack")


@dataclasses.dataclass(frozen=True)
class Network:
    """The links a simulated pipeline runs on.

    Attributes:
        p2p_latency: seconds per activation transfer between stages, whatever its size.
        p2p_bandwidth: bytes per second of an activation transfer.
        migration_bandwidth: bytes per second a layer migration moves (weights and optimizer state).
    """

    p2p_latency: float
    p2p_bandwidth: float
    migration_bandwidth: float

    def p2p(self, activation_bytes: float) -> float:
        """Seconds of one hop of an activation of ``activation_bytes``."""
        return self.p2p_latency + activation_bytes / self.p2p_bandwidth


def oracle(
    trace: Sequence[dict[str, Any]],
    n_stages: int,
    *,
    n_microbatches: int,
    p2p: float,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    speeds: Callable[[int], Sequence[float]] | None = None,
) -> dict[str, Any]:
    """Every step on the makespan-optimal split of its own costs, with free migration: the bound for any balancer.

    ``n_stages`` counts stages (``stages_per_rank`` of them on each rank). Steps with the costs of an earlier step
    reuse its plan (traces hold long runs of equal costs). ``speeds(k)``: every rank's true speed during step ``k``
    (the oracle knows them; see :func:`~dynmo_lightning.sim.simulate_run`).
    """
    total, splits = 0.0, []
    planned: dict[tuple[float, ...], tuple[float, list[int]]] = {}
    for k, entry in enumerate(trace):
        rates = None if speeds is None else [float(v) for v in speeds(k)]
        key = (*entry["fwd"], *entry["bwd"], *entry.get("bwd_weight", ()), *(rates or ()))
        if key not in planned:
            model = StepModel(
                entry["fwd"], entry["bwd"], n_microbatches, schedule, p2p,
                wgt=entry.get("bwd_weight"), stages_per_rank=stages_per_rank, speeds=rates,
            )  # fmt: skip
            found = makespan_split(model, n_stages, start=splits[-1][1] if splits else None)
            assert found is not None  # no memory caps: every split fits
            planned[key] = found
        step_time, split = planned[key]
        total += step_time
        if not splits or splits[-1][1] != split:
            splits.append((entry["step"], split))
    return {"total_time": total, "n_migrations": len(splits) - 1}


def compare(
    trace: Sequence[dict[str, Any]],
    n_ranks: int,
    network: Network,
    *,
    microbatches_per_stage: int = 4,
    every_n_steps: int = 10,
    policies: Sequence[str] = POLICIES,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
) -> dict[str, Any]:
    """Every policy and the oracle on one trace on ``n_ranks`` ranks; speed-ups over the uniform split.

    Args:
        trace: the cost trace.
        n_ranks: pipeline ranks P (``n_ranks * stages_per_rank`` stages).
        network: the links.
        microbatches_per_stage: micro-batches per step over P (the same batch whatever the schedule).
        every_n_steps: steps between the balancer's checks.
        policies: the policies replayed (``"uniform"`` among them: the speed-ups' reference).
        schedule: the pipeline schedule every policy and the oracle run (its task order times every step).
        stages_per_rank: stages on each rank (2 for ``zbv`` and ``dualpipev``, placed in a V).

    Returns:
        ``{"n_stages", "n_ranks", "schedule", "n_microbatches", "n_steps", "p2p_s", "oracle": {...}, "policies":
        {name: {"total_time", "speedup", "share_of_oracle", "n_migrations", "bytes_moved", "rank_seconds",
        "world_size_end", "partitions"}}}``; the oracle's entry has ``total_time``, ``speedup`` and
        ``n_migrations``.
    """
    m, n_stages = microbatches_per_stage * n_ranks, n_ranks * stages_per_rank
    p2p = network.p2p(trace[0]["activation_bytes"][0])
    placement = {"schedule": schedule, "stages_per_rank": stages_per_rank}
    runs = {
        policy: simulate_run(
            trace,
            policy,
            n_stages,
            n_microbatches=m,
            p2p=p2p,
            every_n_steps=every_n_steps,
            bandwidth=network.migration_bandwidth,
            # Consolidation releases ranks to the cluster and takes them back when the full pipeline pays again.
            regrow=policy == "optimal+repack",
            **placement,
        )
        for policy in policies
    }
    uniform = runs["uniform"].total_time
    best = oracle(trace, n_stages, n_microbatches=m, p2p=p2p, **placement)
    best["speedup"] = uniform / best["total_time"]
    out: dict[str, Any] = {
        "n_stages": n_stages, "n_ranks": n_ranks, "schedule": schedule, "n_microbatches": m, "n_steps": len(trace),
        "p2p_s": p2p, "oracle": best, "policies": {},
    }  # fmt: skip
    for name, run in runs.items():
        speedup = uniform / run.total_time
        out["policies"][name] = {
            "total_time": run.total_time,
            "speedup": speedup,
            "share_of_oracle": _share(speedup, best["speedup"]),
            "n_migrations": run.n_migrations,
            "bytes_moved": run.bytes_moved,
            "rank_seconds": run.rank_seconds,
            "world_size_end": run.world_sizes[-1][1],
            "partitions": [[step, split] for step, split in run.partitions],
        }
    return out


def _share(speedup: float, oracle_speedup: float) -> float:
    """How much of the oracle's speed-up a policy reaches, as a ratio of speed-ups (1: all of it)."""
    return speedup / oracle_speedup if oracle_speedup > 0 else math.nan


def seed_reached(sweep: Sequence[dict[str, Any]], seed: float) -> dict[str, Any]:
    """Where a strength sweep reaches the paper's figure: the first strength whose oracle speed-up does, if any.

    Args:
        sweep: ``[{"strength", "oracle_speedup", ...}]`` in the order of increasing strength.
        seed: the paper's speed-up.
    """
    for point in sweep:
        if point["oracle_speedup"] >= seed:
            return {"reached": True, "strength": point["strength"], "oracle_speedup": point["oracle_speedup"]}
    top = max(sweep, key=lambda p: p["oracle_speedup"])
    return {"reached": False, "strength": top["strength"], "oracle_speedup": top["oracle_speedup"]}
