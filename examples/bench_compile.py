"""Compiled against eager layers (``strategy.compile``), side by side on 2 CPU ranks (gpt_small: 12 x 256).

Run (2 CPU ranks; about 15 minutes here, most of it compiling):
    torchrun --standalone --nproc_per_node=2 examples/bench_compile.py --out docs/bench/compile.json

Eager and compiled alternate in one invocation (E C, C E, ...), 5 repeats each; the first compiled run also reports
the wall time to its first step (the compilation). Later compiled runs start from dynamo's cache of this process,
as a long run's steps after the first would. Reported: tokens/s (mean, 95 % interval), the ratio compiled / eager
per repeat pair with its interval, the graphs compiled, and the losses (equal within float noise). This CPU shows
the cost honestly (compile time, small kernels); the gain belongs to GPUs (torchtitan reports +15.7 % tokens/s on
Llama 3.1 8B).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.metadata import version
from typing import Any

import lightning.pytorch as L
from _bench import fit, gpt_arguments, gpt_config

from dynmo_lightning.bench.real import interval95
from dynmo_lightning.pipeline.parallel.compiled import graphs


class FirstStep(L.Callback):
    """Wall time from the start of fit to the end of the first training step, and the losses."""

    def __init__(self) -> None:
        self.start, self.first, self.losses = time.perf_counter(), 0.0, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        if not self.losses:
            self.first = time.perf_counter() - self.start
        self.losses.append(float(out["loss"] if isinstance(out, dict) else out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    gpt_arguments(parser, layers=12)
    parser.add_argument("--out", default="docs/bench/compile.json")
    args = parser.parse_args()
    model, data = gpt_config(args, n_head=8)
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    first: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses: dict[str, list[float]] = {}
    compiled_graphs = []
    for repeat in range(args.repeats):
        for name in ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager"):
            probe, before = FirstStep(), graphs()
            with fit(model, data, [probe], steps=args.steps, measure_from=args.measure_from,
                     compile=name == "compiled") as (trainer, rate):  # fmt: skip
                pass
            rates[name].append(rate)
            first[name].append(probe.first)
            losses.setdefault(name, probe.losses)
            if name == "compiled":
                compiled_graphs.append(graphs() - before)
            if trainer.is_global_zero:
                print(f"repeat {repeat} {name}: {rate:.0f} tokens/s, first step after {probe.first:.1f} s", flush=True)
    if not trainer.is_global_zero:
        return
    ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"], strict=True)]
    report = {
        "config": vars(args), "model": model, "torch": version("torch"),
        "tokens_per_s": rates, "first_step_s": first,
        "mean": {k: interval95(v)[0] for k, v in rates.items()},
        "ci95": {k: list(interval95(v)[1:]) for k, v in rates.items()},
        "ratio_compiled_over_eager": interval95(ratios)[0], "ratio_ci95": list(interval95(ratios)[1:]),
        "compile_s_first_run": first["compiled"][0] - first["eager"][0],
        "graphs_compiled_per_run": compiled_graphs, "losses": losses,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k not in ("losses", "tokens_per_s")}, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
