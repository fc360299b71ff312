"""Consolidation benchmark: throughput before and after the pipeline packs onto fewer processes, and rank-seconds.

Run (4 pipeline ranks; on a 2-core machine they share the cores, so watch rank-seconds more than tokens/s):
    torchrun --standalone --nproc_per_node=4 examples/bench_repack.py --out bench_repack.json

Freezing leaves a small trainable tail early in the run. The same training runs twice in one invocation: with the
balancer only (4 processes for the whole run), then with the balancer allowed to repack (the released processes
exit, so this run comes last). Rank-seconds are the sum over steps of (processes alive x step time).
"""

from __future__ import annotations

import argparse
import json
import time

import lightning.pytorch as L
from _bench import fit

from dynmo_lightning import DynMoBalancer
from dynmo_lightning.callbacks import LayerFreezing


class StepLog(L.Callback):
    """Per-step wall time and world size (rank 0, which is never released)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((time.perf_counter() - self._t, trainer.world_size))


def summarize(log: StepLog, tokens_per_step: int, skip: int) -> dict[str, float]:
    steps = log.steps[skip:]
    before = [t for t, w in steps if w == steps[0][1]]
    after = [t for t, w in steps if w != steps[0][1]]
    return {
        "rank_seconds": sum(t * w for t, w in steps),
        "seconds": sum(t for t, _ in steps),
        "tokens_per_s_before": tokens_per_step * len(before) / sum(before) if before else 0.0,
        "tokens_per_s_after": tokens_per_step * len(after) / sum(after) if after else 0.0,
        "world_size_end": steps[-1][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.2)
    parser.add_argument("--out", default="bench_repack.json")
    args = parser.parse_args()
    model = {"n_layer": args.layers, "n_embd": args.hidden, "n_head": 4, "block_size": args.block}
    data = {"block_size": args.block, "batch_size": args.batch}
    frozen = args.layers  # embedding and all blocks but the last freeze at step 5: the head and one block train
    report = {}
    for name, repack in (("balanced", False), ("balanced+repack", True)):
        log = StepLog()
        callbacks = [
            LayerFreezing(
                mode="schedule", schedule={i: 5 for i in range(frozen)}, start_step=0, max_frozen_fraction=0.9
            ),
            DynMoBalancer(
                every_n_steps=10,
                warmup_steps=3,
                min_gain=0.02,
                repack=repack,
                repack_tolerance=args.tolerance,
                min_stages=1,
            ),
            log,
        ]
        with fit(model, data, callbacks, steps=args.steps, measure_from=1, microbatches=4) as (trainer, _):
            report[name] = summarize(log, args.batch * args.block, skip=1)
        if trainer.is_global_zero:
            print(name, json.dumps(report[name]), flush=True)
    if trainer.is_global_zero:
        report["rank_seconds_saved"] = (
            1 - report["balanced+repack"]["rank_seconds"] / report["balanced"]["rank_seconds"]
        )
        report["config"] = vars(args)
        print(json.dumps(report, indent=2))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
