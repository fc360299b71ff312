"""Each dynamic technique on 2 CPU ranks: static split vs DynMoBalancer, alternating in one invocation.

Run:
    torchrun --standalone --nproc_per_node=2 examples/bench_dynamics.py --dynamics freezing pruning

Prints, per dynamic, tokens/s with the uniform split kept for the whole run and with DynMoBalancer re-partitioning
(measured after ``--measure-from`` steps, when the dynamic has acted), their ratio, and the ratio the 1F1B cost model
predicts from the per-layer costs the balancer measured.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
from _bench import fit, ideal_speedup, world_size

from dynmo_lightning import DynMoBalancer
from dynmo_lightning.balance import partition
from dynmo_lightning.callbacks import GradualPruning, LayerFreezing


def dynamic(name: str, n_layers: int):
    """The dynamic technique under test, acting early so that most measured steps run with it."""
    if name == "freezing":  # freeze the first half of the layers by step 10 (AutoFreeze would decide the same way)
        return LayerFreezing(mode="schedule", schedule={i: 5 + i for i in range(n_layers // 2)}, start_step=0)
    if name == "pruning":
        return GradualPruning(final_sparsity=0.75, start_step=2, end_step=12, every_n_steps=2)
    raise ValueError(f"unknown dynamic {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dynamics", nargs="+", default=["freezing", "pruning"])
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (gpt_small: 12)")
    parser.add_argument("--hidden", type=int, default=256, help="gpt_small: 256")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--measure-from", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="A/B pairs")
    parser.add_argument("--out", default="bench_dynamics.json")
    args = parser.parse_args()

    model = {"n_layer": args.layers, "n_embd": args.hidden, "n_head": 8, "block_size": args.block}
    data = {"block_size": args.block, "batch_size": args.batch}
    n_stages, n_layers = world_size(), args.layers + 2
    report = {}
    for name in args.dynamics:
        runs: dict[str, list[float]] = {"static": [], "balanced": []}
        ideal = partitions = None
        for _ in range(args.repeats):
            _, tps = fit(model, data, [dynamic(name, n_layers)], steps=args.steps, measure_from=args.measure_from)
            runs["static"].append(tps)
            balancer = DynMoBalancer(every_n_steps=10, warmup_steps=3, min_gain=0.02)
            trainer, tps = fit(
                model, data, [dynamic(name, n_layers), balancer], steps=args.steps, measure_from=args.measure_from
            )
            runs["balanced"].append(tps)
            static_split = partition([1.0] * n_layers, n_stages, method="uniform")
            ideal = ideal_speedup(balancer.tracker.values, static_split, n_stages, 4)
            partitions = trainer.strategy.partitions
        mean = {k: sum(v) / len(v) for k, v in runs.items()}
        report[name] = {
            "tokens_per_s": mean,
            "speedup": mean["balanced"] / mean["static"],
            "ideal_speedup_from_measured_costs": ideal,
            "partitions": partitions,
            "raw": runs,
        }
        if dist.get_rank() == 0:
            print(
                f"{name:10s} static {mean['static']:8.0f} tok/s  balanced {mean['balanced']:8.0f} tok/s  "
                f"ratio {report[name]['speedup']:.2f}  ideal {ideal:.2f}  partitions {partitions}",
                flush=True,
            )
    if dist.get_rank() == 0:
        report["config"] = vars(args)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
