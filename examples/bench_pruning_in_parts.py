"""Structured pruning of layers held in parts: a pruned block's measured time against the fraction of units it kept.

Run (4 CPU ranks; on a 2-core machine they share the cores, so the ratios say more than the times):
    torchrun --standalone --nproc_per_node=4 examples/bench_pruning_in_parts.py --out docs/bench/pruning_in_parts.json

Under each parallel mode (``tp2``: P = 2 x T = 2; ``fsdp``: P = 2 x D = 2), the reference GPT trains with every
block pruned at step 0 to a kept fraction of its MLP neurons and attention heads (``GradualPruning``, layer scope,
units in multiples of 2: the pruned layers are gathered whole, pruned and made parts again,
``pipeline/stage/reshape.py``), then the strategy's profiler measures every layer's forward and backward inside real
steps (the balancer's own numbers, averaged over a stage's processes). The kept fractions alternate within each repeat
(rotated), every repeat a fresh run of each. Reported per mode and kept fraction: a block's forward + backward time
(mean over blocks, profiled steps and repeats, with the 95 % interval over repeats) and its ratio to the unpruned
block's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import lightning.pytorch as L
import torch
from _bench import fit, gpt_arguments, gpt_config

from dynmo_lightning.bench.real import interval95
from dynmo_lightning.callbacks import GradualPruning

#: Every mode by its key: the strategy settings it runs with.
MODES: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "fsdp": {"data_parallel_size": 2, "data_parallel": "fsdp"},
}
KEPT = (1.0, 0.75, 0.5, 0.25)


class BlockTimes(L.Callback):
    """Every block's profiled forward + backward seconds, from step ``first`` on (each step profiled)."""

    def __init__(self, first: int, blocks: range) -> None:
        self.first, self.blocks = first, blocks
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Profile every measured step."""
        if trainer.global_step >= self.first:
            trainer.strategy.pipeline_control.request_profile()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, out: Any, batch: Any, i: int) -> None:
        """Read the step's per-layer costs (collective)."""
        if trainer.global_step - 1 >= self.first:
            costs = trainer.strategy.pipeline_control.profile_results()
            self.times += [costs[b]["fwd"] + costs[b]["bwd"] for b in self.blocks]


def main() -> None:
    """Run the A/B and write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpt_arguments(parser, layers=4)
    parser.add_argument("--out", default="docs/bench/pruning_in_parts.json")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    model, data = gpt_config(args, n_head=8)
    blocks = range(1, args.layers + 1)  # pipeline layers: embedding, blocks, head
    results: dict[str, dict[str, list[float]]] = {m: {str(k): [] for k in KEPT} for m in args.modes.split(",")}
    for repeat in range(args.repeats):
        order = KEPT[repeat % len(KEPT) :] + KEPT[: repeat % len(KEPT)]
        for mode in results:
            for kept in order:
                probe = BlockTimes(args.measure_from, blocks)
                callbacks: list[L.Callback] = [probe]
                if kept < 1.0:
                    cut = 1.0 - kept  # at the end of step 0, every module alike
                    callbacks.append(GradualPruning(initial_sparsity=cut, final_sparsity=cut, start_step=0, end_step=1,
                                                    every_n_steps=1, scope="layer", multiple_of=2))  # fmt: skip
                with fit(model, data, callbacks, steps=args.steps, measure_from=args.measure_from, **MODES[mode]):
                    pass
                results[mode][str(kept)].append(statistics.fmean(probe.times))
    if int(os.environ.get("RANK", "0")):
        return
    table = {}
    for mode, by_kept in results.items():
        full = statistics.fmean(by_kept["1.0"])
        table[mode] = {
            kept: {"block_seconds": interval95(times), "over_unpruned": statistics.fmean(times) / full}
            for kept, times in by_kept.items()
        }
        print(mode, {k: round(v["over_unpruned"], 3) for k, v in table[mode].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump({"modes": table, "kept_fractions": KEPT, "args": vars(args), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
