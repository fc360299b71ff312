"""Validate the simulator against the real CPU pipeline: simulated vs measured step times.

Run (once per pipeline size):
    torchrun --standalone --nproc_per_node=2 examples/validate_sim.py --out docs/bench/validate_sim_p2.json
    torchrun --standalone --nproc_per_node=4 examples/validate_sim.py --out docs/bench/validate_sim_p4.json

Every step is profiled (per-layer forward/backward time, gathered from all stages) and its pipeline schedule timed
(forward and backward of all micro-batches, on rank 0). Each step's measured costs and partition then go through the
discrete-event simulator (``dynmo_lightning.sim.simulate_layers``, the same stage-cost code as the runtime), with the
one-hop transfer time measured by a ping-pong of one activation. Reported: mean measured vs mean simulated schedule
time and the relative error, per schedule. Note: with more ranks than cores the ranks share CPUs, which the
simulator (one worker per stage) does not model.
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as L
import torch
import torch.distributed as dist
from _bench import fit, world_size

from dynmo_lightning.sim import simulate_layers


class Measure(L.Callback):
    """Profile every step after ``skip`` and keep (costs, partition, measured schedule seconds)."""

    def __init__(self, skip: int) -> None:
        self.skip, self.steps = skip, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.skip:
            trainer.strategy.pipeline_control.request_profile()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        costs = trainer.strategy.pipeline_control.profile_results() if trainer.global_step > self.skip else None
        if costs is not None:
            self.steps.append(
                (
                    costs,
                    trainer.strategy.pipeline_control.layers_per_stage,
                    trainer.strategy.pipeline_control.schedule_seconds,
                )
            )


def hop_seconds(numel: int, repeats: int = 20) -> float:
    """One-way time of sending one activation between ranks 0 and 1 (half a ping-pong)."""
    buf = torch.zeros(numel)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return (time.perf_counter() - t0) / repeats / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", default="validate_sim.json")
    args = parser.parse_args()
    model = {"n_layer": args.layers, "n_embd": args.hidden, "n_head": 4, "block_size": args.block}
    data = {"block_size": args.block, "batch_size": args.batch}
    report = {"world_size": world_size(), "config": vars(args)}
    for schedule in ("1f1b", "gpipe"):
        measure = Measure(args.skip)
        with fit(
            model,
            data,
            [measure],
            steps=args.steps,
            measure_from=args.skip,
            microbatches=args.microbatches,
            schedule=schedule,
        ) as (trainer, _):
            mb = args.batch // args.microbatches
            p2p = hop_seconds(mb * args.block * args.hidden)
        measured, simulated = [], []
        for costs, split, seconds in measure.steps:
            fwd = [costs[i]["fwd"] for i in range(len(costs))]
            bwd = [costs[i]["bwd"] for i in range(len(costs))]
            measured.append(seconds)
            simulated.append(simulate_layers(fwd, bwd, split, args.microbatches, schedule, p2p).step_time)
        m, s = sum(measured) / len(measured), sum(simulated) / len(simulated)
        report[schedule] = {
            "measured_s": m,
            "simulated_s": s,
            "relative_error": (s - m) / m,
            "p2p_s": p2p,
            "steps": len(measured),
        }
        if trainer.is_global_zero:
            print(
                f"P={world_size()} {schedule}: measured {m * 1e3:.1f} ms, simulated {s * 1e3:.1f} ms, "
                f"error {100 * (s - m) / m:+.1f}%",
                flush=True,
            )
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
