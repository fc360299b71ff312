"""Benchmark of diffusion balancing between neighbours vs the centralised planner (gather every cost, plan).

Real: P = 2 and 4 processes (gloo, this machine) run the protocol point-to-point from a uniform split of a model
whose first quarter of layers is frozen (cheaper), and the centralised way: ``all_gather_object`` of every layer's
costs, then ``partition(method="optimal")``; median of ``--repeats``. Simulated: 64, 256 and 1,024 stages run the
same stage code in one process (real round counts and per-stage compute), priced by
:mod:`dynmo_lightning.sim.planning` at 10 us and 100 us per message, beside the centralised gather-and-plan with
the planner's measured time.

Run:
    python examples/bench_diffusion.py --out docs/bench_diffusion.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

LATENCIES = (10e-6, 100e-6)
BANDWIDTH = 10e9  # bytes per second of a link (the numbers are latency-bound either way)
LAYER_BYTES = 40  # one layer's numbers for the central planner: compute, memory, fwd, bwd, bytes (float64 each)


def layer_costs(n_layers: int, seed: int = 0) -> list[float]:
    """Integer microseconds: random layers, the first quarter frozen (a third of the cost)."""
    rng = random.Random(seed)
    return [float(rng.randint(300, 1000) // (3 if i < n_layers // 4 else 1)) for i in range(n_layers)]


def balancer_layers(costs: list[float], split: list[int]) -> list[list[tuple[float, ...]]]:
    """Each stage's layers as the balancer builds them: ``(compute, memory, fwd, bwd, bytes)`` (a 432-byte card)."""
    from dynmo_lightning.balance.diffusion import stage_layers

    fwd, bwd, moving = [c / 3 for c in costs], [2 * c / 3 for c in costs], [1e6] * len(costs)
    return stage_layers(costs, split, None, (fwd, bwd, moving))


def uniform(n_layers: int, n_stages: int) -> list[int]:
    size, extra = divmod(n_layers, n_stages)
    return [size + 1] * extra + [size] * (n_stages - extra)


def worker(out: Path, n_layers: int, repeats: int) -> None:
    """One rank of the real measurement (started by :func:`real`)."""
    import torch
    import torch.distributed as dist

    from dynmo_lightning.balance import partition
    from dynmo_lightning.balance.diffusion import start_stages
    from dynmo_lightning.pipeline.layout import PipelineGroup
    from dynmo_lightning.pipeline.neighbours import run_stage

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipe, costs = PipelineGroup(rank, None, list(range(world))), layer_costs(n_layers)
    split = uniform(n_layers, world)
    own = balancer_layers(costs, split)
    diffusion, central, stats = [], [], None
    for _ in range(repeats):
        stage = start_stages(own)[rank]  # this rank's stage only: it knows its own layers
        dist.barrier()
        stats = run_stage(stage, pipe, torch.device("cpu"))
        diffusion.append(stats.seconds)
        dist.barrier()
        t0 = time.perf_counter()
        parts: list = [None] * world
        dist.all_gather_object(parts, own[rank])
        planned = partition([layer[0] for part in parts for layer in part], world)
        central.append(time.perf_counter() - t0)
    assert stats is not None and stats.layers_per_stage == planned
    if rank == 0:
        result = {"stages": world, "layers": n_layers, "rounds": stats.rounds, "probes": stats.probes,
                  "bytes_sent_per_process": stats.bytes_sent, "diffusion_ms": 1e3 * statistics.median(diffusion),
                  "central_ms": 1e3 * statistics.median(central)}  # fmt: skip
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


def real(n_stages: int, n_layers: int, repeats: int) -> dict:
    """Launch ``n_stages`` processes running :func:`worker`; returns rank 0's numbers."""
    from dynmo_lightning.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, __file__, "--worker", str(out), "--layers", str(n_layers), "--repeats", str(repeats)]
        codes = run_ranks(n_stages, argv, log_dir=Path(tmp), tag="diffusion", timeout=600)
        if any(c != 0 for c in codes):
            logs = "\n".join(p.read_text()[-2000:] for p in Path(tmp).glob("*.log"))
            raise RuntimeError(f"benchmark ranks failed: {codes}\n{logs}")
        return json.loads(out.read_text())


def simulated(n_stages: int, n_layers: int) -> dict:
    """Round count and per-stage compute from the in-memory protocol; times from the latency model."""
    from dynmo_lightning.balance import bottleneck, partition
    from dynmo_lightning.balance.diffusion import card_width, drive, start_stages
    from dynmo_lightning.sim import gather_plan_time, neighbour_plan_time

    costs, start = layer_costs(n_layers), uniform(n_layers, n_stages)
    t0 = time.perf_counter()
    stages = start_stages(balancer_layers(costs, start))  # the same stage code, cards passed in memory
    rounds = sum(1 for _ in drive(stages))
    compute_s = (time.perf_counter() - t0) / n_stages  # the stages run in parallel: one stage's share
    split, card = [len(s.layers) for s in stages], 8 * card_width(stages[0].width)
    plan = []
    for _ in range(3):
        t0 = time.perf_counter()
        best = partition(costs, n_stages)
        plan.append(time.perf_counter() - t0)
    plan_s = statistics.median(plan)
    assert bottleneck(costs, split) == bottleneck(costs, best)
    row = {"stages": n_stages, "layers": n_layers, "rounds": rounds, "probes": stages[0].probes,
           "card_bytes": card, "bytes_sent_per_process": 2 * rounds * card,
           "central_bytes_per_process": n_layers * LAYER_BYTES, "stage_compute_ms": 1e3 * compute_s,
           "optimal_plan_ms": 1e3 * plan_s}  # fmt: skip
    for latency in LATENCIES:
        us = f"{latency * 1e6:.0f}us"
        model = {"latency": latency, "bandwidth": BANDWIDTH}
        row[f"diffusion_ms_{us}"] = 1e3 * neighbour_plan_time(rounds, card, n_stages, compute_s=compute_s, **model)
        row[f"central_ms_{us}"] = 1e3 * gather_plan_time(n_layers, n_stages, LAYER_BYTES, plan_s=plan_s, **model)
    return row


def table(results: dict) -> str:
    """The README's markdown table."""
    lines = [
        "| stages | layers | rounds | diffusion @10 µs | central @10 µs | diffusion @100 µs | central @100 µs | "
        "bytes/process diffusion vs central |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["real"]:
        sent = f"{r['bytes_sent_per_process']} vs {r['layers'] * LAYER_BYTES}"
        lines.append(f"| {r['stages']} (real) | {r['layers']} | {r['rounds']} | {r['diffusion_ms']:.1f} ms (gloo) | "
                     f"{r['central_ms']:.1f} ms (gloo) | | | {sent} |")  # fmt: skip
    for r in results["simulated"]:
        cells = [f"{r[f'{w}_ms_{us}']:.1f} ms" for us in ("10us", "100us") for w in ("diffusion", "central")]
        lines.append(f"| {r['stages']} | {r['layers']} | {r['rounds']} | {' | '.join(cells)} | "
                     f"{r['bytes_sent_per_process']} vs {r['central_bytes_per_process']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/bench_diffusion.json"))
    parser.add_argument("--layers", type=int, default=64, help="layers of the real runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="*", default=[64, 256, 1024], help="simulated stage counts")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.layers, args.repeats)
        return
    results = {"real": [real(p, args.layers, args.repeats) for p in (2, 4)], "simulated": []}
    for p in args.stages:
        results["simulated"].append(simulated(p, 1000 if p == 64 else 4 * p))
        print(json.dumps(results["simulated"][-1]), flush=True)
    results["table"] = table(results)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(results["table"])


if __name__ == "__main__":
    main()
