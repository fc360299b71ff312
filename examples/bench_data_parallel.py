"""Data parallelism inside the stages: ``data_parallel`` ddp, replicate and fsdp side by side (DP = 2 x PP = 2).

Run (4 CPU ranks; on a 2-core machine they share the cores, so the ratios say more than the rates):
    torchrun --standalone --nproc_per_node=4 examples/bench_data_parallel.py --out docs/bench/data_parallel.json

The reference GPT trains the same steps once per mode per repeat, the modes alternating (A B C, B C A, ...) in one
invocation so that machine drift cancels. Reported per mode: tokens/s (mean and 95 % interval over the repeats, and
the ratio to ddp), and what every process holds just before an optimizer step (bytes of parameters, gradients and
optimizer state: local shards under fsdp), with the losses of the first repeat (equal across modes).
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from _bench import fit, gpt_arguments, gpt_config

from dynmo_lightning.bench.real import interval95
from dynmo_lightning.protocol import local_part

MODES = ("ddp", "replicate", "fsdp")


class Held(L.Callback):
    """Bytes of parameters, gradients and optimizer state this process holds before the step's optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.held: dict[str, int] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.step:
            return

        def size(tensors: list[torch.Tensor]) -> int:
            return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)

        params = list(pl_module.parameters())
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        self.held = {"params": size(params), "grads": size([p.grad for p in params if p.grad is not None]),
                     "optim": size(state)}  # fmt: skip

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        self.losses.append(float(out["loss"] if isinstance(out, dict) else out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    gpt_arguments(parser, layers=6, batch_help="per replica")
    parser.add_argument("--out", default="docs/bench/data_parallel.json")
    args = parser.parse_args()
    model, data = gpt_config(args, n_head=4)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    held: dict[str, list[dict[str, int]]] = {}
    losses: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        order = MODES[repeat % 3 :] + MODES[: repeat % 3]
        for mode in order:
            probe = Held(args.measure_from)
            with fit(model, data, [probe], steps=args.steps, measure_from=args.measure_from,
                     data_parallel_size=2, data_parallel=mode) as (trainer, rate):  # fmt: skip
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, probe.held)
            rates[mode].append(rate)
            held.setdefault(mode, every)
            losses.setdefault(mode, probe.losses)
            if trainer.is_global_zero:
                print(f"repeat {repeat} {mode}: {rate:.0f} tokens/s", flush=True)
    if not trainer.is_global_zero:
        return
    report: dict[str, Any] = {"config": vars(args), "torch": version("torch"), "modes": {}}
    ddp_mean = interval95(rates["ddp"])[0]
    for mode in MODES:
        mean, low, high = interval95(rates[mode])
        ratios = [r / d for r, d in zip(rates[mode], rates["ddp"], strict=True)]
        ratio, rlow, rhigh = interval95(ratios)
        report["modes"][mode] = {
            "tokens_per_s": rates[mode], "mean": mean, "ci95": [low, high],
            "ratio_to_ddp": ratio, "ratio_ci95": [rlow, rhigh],
            "held_bytes_per_rank": held[mode],
            "held_vs_ddp": [sum(h.values()) / sum(d.values()) for h, d in zip(held[mode], held["ddp"], strict=True)],
            "losses": losses[mode],
        }  # fmt: skip
    report["ddp_mean_tokens_per_s"] = ddp_mean
    print(json.dumps({m: {k: v for k, v in r.items() if k != "tokens_per_s"} for m, r in report["modes"].items()},
                     indent=1))  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
