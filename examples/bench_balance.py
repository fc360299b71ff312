"""Benchmark of dynamic balancing on CPU ranks: throughput static vs balanced, profiler overhead, migration speed,
planning time. Policies alternate (A B A B) in one invocation so machine drift cancels; ratios are reported.

Run (2 pipeline ranks):
    torchrun --standalone --nproc_per_node=2 examples/bench_balance.py --out docs/bench/bench_balance.json

The model is a GPT whose blocks have very different MLP widths (16x ... 1x the hidden size), the situation dynamic
techniques create; a uniform split is unbalanced and the balancer should move the boundary.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import AbstractContextManager

import lightning.pytorch as L
import torch
import torch.distributed as dist
from _bench import fit

from dynmo_lightning import DynMoBalancer
from dynmo_lightning.balance import diffuse, partition
from dynmo_lightning.bench.real import ideal_ratio

RATIOS = [16, 16, 8, 4, 1, 1, 1, 1]


class AlwaysProfile(L.Callback):
    """Profiles every step (to measure the profiler's own cost)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.pipeline_control.request_profile()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.pipeline_control.profile_results()


def run(args, callbacks: list[L.Callback]) -> AbstractContextManager[tuple[L.Trainer, float]]:
    model = {"n_layer": len(RATIOS), "n_embd": args.hidden, "n_head": 4, "block_size": args.block, "mlp_ratio": RATIOS}
    data = {"block_size": args.block, "batch_size": args.batch}
    return fit(model, data, callbacks, steps=args.steps, measure_from=args.measure_from, microbatches=args.microbatches)


def migration_speed(trainer: L.Trainer, repeats: int) -> dict[str, float]:
    """MB/s of moving layers back and forth vs a plain send/recv of the same number of bytes."""
    strategy = trainer.strategy
    base = strategy.pipeline_control.layers_per_stage
    other = [base[0] + 2, base[1] - 2] if base[1] > 2 else [base[0] - 2, base[1] + 2]
    moved, seconds = 0, 0.0
    for i in range(repeats):
        stats = strategy.pipeline_control.repartition(other if i % 2 == 0 else base)
        moved += stats.bytes_sent + stats.bytes_received
        seconds += stats.seconds
    total = torch.tensor([moved], dtype=torch.float64)
    dist.all_reduce(total)  # every byte counted once by its sender and once by its receiver
    per_move = int(total.item() / 2 / repeats)
    buf = torch.empty(per_move, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(repeats):
        src = 0 if i % 2 == 0 else 1
        if dist.get_rank() == src:
            dist.send(buf, dst=1 - src)
        else:
            dist.recv(buf, src=src)
    raw = time.perf_counter() - t0
    return {
        "bytes_per_migration": per_move,
        "migration_MBps": per_move * repeats / seconds / 1e6,
        "send_recv_MBps": per_move * repeats / raw / 1e6,
        "migration_s_per_MB": seconds / repeats / (per_move / 1e6),
    }


def planning_time() -> dict[str, float]:
    costs = [float(x) for x in torch.rand(1000, generator=torch.Generator().manual_seed(0)) + 0.1]
    out = {}
    for name, fn in [("optimal", lambda: partition(costs, 64, method="optimal"))]:
        fn()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        out[f"plan_{name}_1000x64_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    start = partition(costs, 64, method="uniform")
    t0 = time.perf_counter()
    result = diffuse(costs, start)
    out["plan_diffusion_1000x64_ms"] = (time.perf_counter() - t0) * 1e3
    out["diffusion_rounds"] = result.rounds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--measure-from", type=int, default=15, help="steps before this are warm-up/balancing")
    parser.add_argument("--repeats", type=int, default=2, help="A/B pairs")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", default="bench_balance.json")
    args = parser.parse_args()

    results: dict[str, list[float]] = {"static": [], "balanced": [], "profiled_static": []}
    ideal, partitions, migration = None, None, {}
    for repeat in range(args.repeats):
        with run(args, []) as (_, tps):
            results["static"].append(tps)
        balancer = DynMoBalancer(every_n_steps=10, warmup_steps=3, min_gain=0.02)
        with run(args, [balancer]) as (trainer, tps):
            results["balanced"].append(tps)
            partitions = trainer.strategy.pipeline_control.partitions
            if repeat == args.repeats - 1:  # moves layers, in the balanced run's world
                migration = migration_speed(trainer, repeats=6)
        with run(args, [AlwaysProfile()]) as (_, tps):
            results["profiled_static"].append(tps)
        ideal = ideal_ratio(balancer.tracker.values, 2, args.microbatches, 0.0)
    mean = {k: sum(v) / len(v) for k, v in results.items()}
    overhead = 100 * (mean["static"] / mean["profiled_static"] - 1)
    report = {
        "tokens_per_s": mean,
        "speedup_balanced_over_static": mean["balanced"] / mean["static"],
        # what the 1F1B cost model predicts from the measured per-layer costs (fill/drain included)
        "ideal_speedup_from_measured_costs": ideal,
        "partitions": partitions,
        "profiled_step_overhead_pct": overhead,
        # DynMoBalancer() profiles one step in every_n_steps // 5 = 10 by default
        "profiling_overhead_at_default_sampling_pct": overhead / DynMoBalancer().policy.profile_every_n_steps,
        **migration,
        **planning_time(),
        "config": vars(args),
        "raw": results,
    }
    if trainer.is_global_zero:
        print(json.dumps(report, indent=2))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
