"""Benchmark of diffusion balancing between neighbours vs the centralised planner (gather every cost, plan).

Both modes of the protocol: ``exact`` (the optimal split) and ``sweep`` (within one layer's cost of it).
Real: P = 2 and 4 processes (gloo, this machine) run the protocol point-to-point from a uniform split of a model
whose first quarter of layers is frozen (cheaper), and the centralised way: ``all_gather_object`` of every layer's
costs, then ``partition(method="optimal")``; median of ``--repeats``. Simulated: 64, 256 and 1,024 stages run the
same stage code in one process (real round counts and per-stage compute), priced by
:mod:`dynmo_lightning.sim.planning` at 10 us and 100 us per message, beside the centralised gather-and-plan with
the planner's measured time: the all-gather as recursive doubling (``log2 P`` latencies, its best) and as a ring
(``P - 1`` latencies, what gloo and NCCL run); and a centralised planner of the sweep's own cut (gather, then
:func:`~dynmo_lightning.balance.diffusion.sweep_mode.sweep_split`).

Run:
    python examples/bench_diffusion.py --out docs/bench/bench_diffusion.json
"""

from __future__ import annotations

import argparse
import gc
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
    from dynmo_lightning.balance.diffusion.driver import stage_layers

    fwd, bwd, moving = [c / 3 for c in costs], [2 * c / 3 for c in costs], [1e6] * len(costs)
    return stage_layers(costs, split, None, (fwd, bwd, moving))


def uniform(n_layers: int, n_stages: int) -> list[int]:
    size, extra = divmod(n_layers, n_stages)
    return [size + 1] * extra + [size] * (n_stages - extra)


def worker(out: Path, n_layers: int, repeats: int) -> None:
    """One rank of the real measurement (started by :func:`real`)."""
    import torch.distributed as dist

    from dynmo_lightning.balance import bottleneck, partition
    from dynmo_lightning.balance.diffusion.driver import MODES, start_stages
    from dynmo_lightning.pipeline.stage.neighbours import run_stage
    from dynmo_lightning.pipeline.topology.mesh import PipelineGroup

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipe, costs = PipelineGroup(rank, None, list(range(world))), layer_costs(n_layers)
    split = uniform(n_layers, world)
    own = balancer_layers(costs, split)
    seconds: dict[str, list[float]] = {mode: [] for mode in (*MODES, "central")}
    stats = {}
    for _ in range(repeats):
        for mode in MODES:
            stage = start_stages(own, mode=mode)[rank]  # this rank's stage only: it knows its own layers
            dist.barrier()
            stats[mode] = run_stage(stage, pipe)
            seconds[mode].append(stats[mode].seconds)
        dist.barrier()
        t0 = time.perf_counter()
        parts: list = [None] * world
        dist.all_gather_object(parts, own[rank])
        planned = partition([layer[0] for part in parts for layer in part], world)
        seconds["central"].append(time.perf_counter() - t0)
    exact, sweep = stats["exact"], stats["sweep"]
    assert exact.layers_per_stage == planned
    best, reached = bottleneck(costs, planned), bottleneck(costs, sweep.layers_per_stage)
    assert reached < best + max(costs)
    if rank == 0:
        ms = {mode: 1e3 * statistics.median(s) for mode, s in seconds.items()}
        result = {"stages": world, "layers": n_layers, "rounds": exact.rounds, "probes": exact.probes,
                  "bytes_sent_per_process": exact.bytes_sent, "diffusion_ms": ms["exact"],
                  "central_ms": ms["central"], "sweep_rounds": sweep.rounds,
                  "sweep_bytes_sent_per_process": sweep.bytes_sent, "sweep_ms": ms["sweep"],
                  "optimal_bottleneck": best, "sweep_bottleneck": reached}  # fmt: skip
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


def run_in_memory(costs: list[float], start: list[int], mode: str) -> tuple[list[int], int, float, int, int]:
    """Drive every stage in one process: split, rounds, one stage's compute (s), probes, card bytes.

    The cyclic garbage collector is off while it runs: one process holding every stage's tables would make it
    sweep far more objects than any real stage's process ever holds.
    """
    from dynmo_lightning.balance.diffusion.driver import drive, start_stages

    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        stages = start_stages(balancer_layers(costs, start), mode=mode)  # the same stage code, cards in memory
        rounds = sum(1 for _ in drive(stages))
        compute_s = (time.perf_counter() - t0) / len(start)  # the stages run in parallel: one stage's share
    finally:
        gc.enable()
    return [s.size for s in stages], rounds, compute_s, stages[0].probes, 8 * stages[0].card_floats


def timed(fn, *args) -> float:
    """Median seconds of three calls."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def simulated(n_stages: int, n_layers: int) -> dict:
    """Round counts and per-stage compute from the in-memory protocol (both modes); times from the latency model."""
    from dynmo_lightning.balance import bottleneck, partition
    from dynmo_lightning.balance.diffusion.sweep_mode import sweep_split
    from dynmo_lightning.sim import gather_plan_time, neighbour_plan_time

    costs, start = layer_costs(n_layers), uniform(n_layers, n_stages)
    split, rounds, compute_s, probes, card = run_in_memory(costs, start, "exact")
    swept, sweep_rounds, sweep_s, _, sweep_card = run_in_memory(costs, start, "sweep")
    best = partition(costs, n_stages)
    plan_s, approx_s = timed(partition, costs, n_stages), timed(sweep_split, costs, n_stages)
    assert bottleneck(costs, split) == bottleneck(costs, best)
    assert swept == sweep_split(costs, n_stages)
    row = {"stages": n_stages, "layers": n_layers, "rounds": rounds, "probes": probes,
           "card_bytes": card, "bytes_sent_per_process": 2 * rounds * card,
           "central_bytes_per_process": n_layers * LAYER_BYTES, "stage_compute_ms": 1e3 * compute_s,
           "optimal_plan_ms": 1e3 * plan_s, "sweep_rounds": sweep_rounds, "sweep_card_bytes": sweep_card,
           "sweep_bytes_sent_per_process": 2 * sweep_rounds * sweep_card, "sweep_stage_compute_ms": 1e3 * sweep_s,
           "sweep_split_plan_ms": 1e3 * approx_s, "optimal_bottleneck": bottleneck(costs, best),
           "sweep_bottleneck": bottleneck(costs, swept), "max_layer": max(costs)}  # fmt: skip
    for latency in LATENCIES:
        us = f"{latency * 1e6:.0f}us"
        model = {"latency": latency, "bandwidth": BANDWIDTH}
        gather = {"n_layers": n_layers, "n_stages": n_stages, "layer_bytes": LAYER_BYTES, **model}
        row[f"diffusion_ms_{us}"] = 1e3 * neighbour_plan_time(rounds, card, n_stages, compute_s=compute_s, **model)
        row[f"sweep_ms_{us}"] = 1e3 * neighbour_plan_time(
            sweep_rounds, sweep_card, n_stages, compute_s=sweep_s, **model
        )
        row[f"central_ms_{us}"] = 1e3 * gather_plan_time(plan_s=plan_s, **gather)
        row[f"central_ring_ms_{us}"] = 1e3 * gather_plan_time(plan_s=plan_s, ring=True, **gather)
        row[f"central_sweep_split_ms_{us}"] = 1e3 * gather_plan_time(plan_s=approx_s, **gather)
    return row


def table(results: dict) -> str:
    """The README's markdown table: planning time per method at each latency, the sweep's bottleneck."""
    lines = [
        "| stages | layers | rounds exact / sweep | @10 µs: exact | sweep | central (tree) | central (ring) | "
        "@100 µs: exact | sweep | central (tree) | central (ring) | sweep bottleneck ÷ optimal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["real"]:
        ratio = r["sweep_bottleneck"] / r["optimal_bottleneck"]
        lines.append(f"| {r['stages']} (real, gloo) | {r['layers']} | {r['rounds']} / {r['sweep_rounds']} | "
                     f"{r['diffusion_ms']:.1f} ms | {r['sweep_ms']:.1f} ms | {r['central_ms']:.1f} ms | | "
                     f"| | | | {ratio:.3f} |")  # fmt: skip
    for r in results["simulated"]:
        cells = [f"{r[f'{w}_ms_{us}']:.1f} ms" for us in ("10us", "100us")
                 for w in ("diffusion", "sweep", "central", "central_ring")]  # fmt: skip
        ratio = r["sweep_bottleneck"] / r["optimal_bottleneck"]
        lines.append(f"| {r['stages']} | {r['layers']} | {r['rounds']} / {r['sweep_rounds']} | {' | '.join(cells)} | "
                     f"{ratio:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/bench_diffusion.json"))
    parser.add_argument("--layers", type=int, default=64, help="layers of the real runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stages", type=int, nargs="*", default=[64, 256, 1024], help="simulated stage counts")
    parser.add_argument("--real", type=int, nargs="*", default=[2, 4], help="process counts of the real runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.layers, args.repeats)
        return
    results = {"real": [real(p, args.layers, args.repeats) for p in args.real], "simulated": []}
    for p in args.stages:
        results["simulated"].append(simulated(p, 1000 if p == 64 else 4 * p))
        print(json.dumps(results["simulated"][-1]), flush=True)
    results["table"] = table(results)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(results["table"])


if __name__ == "__main__":
    main()
