"""Data parallelism inside the stages: ddp, replicate, fsdp and fsdp's lean way side by side (DP = 2 x PP = 2).

Run (4 CPU ranks; on a 2-core machine they share the cores, so the ratios say more than the rates):
    torchrun --standalone --nproc_per_node=4 examples/bench_data_parallel.py --out docs/bench/data_parallel.json

The reference GPT trains the same steps once per mode per repeat, the modes alternating (A B C D, B C D A, ...) in
one invocation so that machine drift cancels. Reported per mode, under its key (``ddp``, ``replicate``, ``fsdp``, and
``fsdp_memory=lean``: ``data_parallel="fsdp"`` with ``fsdp_memory="lean"``):

- ``tokens_per_s``: every repeat's rate from step ``--measure-from`` on (mean, 95 % interval, ratio to ddp);
- ``step_peak_bytes``: every process's measured peak during one training step's schedule (step 2 of the first
  repeat, up to its optimizer step: what the memory model prices): the tensors the process held when the step began
  (its parameters, optimizer state, buffers and the gradients it keeps; DTensors' local parts) plus the most its
  resident memory grew above where it began, read from the kernel
  (``dynmo_lightning.bench.allocations.ResidentPeak``: every thread's allocations, FSDP2's storage resizes included,
  with freed blocks returned at once); ``with_optimizer_step_peak_bytes`` the same through the optimizer step;
- ``predicted_peak_bytes``: the memory model's prediction for the same process and step (the balancer's path: the
  layers profiled in step 1, smoothed by ``CostTracker``, priced by ``MemoryModel`` under the schedule's own task
  order) and its error against ``step_peak_bytes``;
- ``held_bytes_per_rank``: parameters, gradients and optimizer state held just before an optimizer step (at rest);
- ``losses``: the first repeat's (equal across modes within float noise).
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

from dynmo_lightning.balance import CostTracker
from dynmo_lightning.balance.steptime.memory_model import MemoryModel
from dynmo_lightning.bench.allocations import ResidentPeak, serve_large_blocks_from_mappings, storage_bytes
from dynmo_lightning.bench.real import interval95
from dynmo_lightning.protocol import local_part

#: Every mode by its key: the strategy settings it runs with.
MODES: dict[str, dict[str, Any]] = {
    "ddp": {"data_parallel": "ddp"},
    "replicate": {"data_parallel": "replicate"},
    "fsdp": {"data_parallel": "fsdp"},
    "fsdp_memory=lean": {"data_parallel": "fsdp", "fsdp_memory": "lean"},
}


class StepMemory(L.Callback):
    """The memory model's prediction (profiled at ``profile_step``) and the measured peak of ``measure_step``."""

    def __init__(self, profile_step: int, measure_step: int) -> None:
        self.profile_step, self.measure_step = profile_step, measure_step
        self.result: dict[str, Any] = {}
        self.losses: list[float] = []
        self._peaks: list[ResidentPeak] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        strategy, step = trainer.strategy, trainer.global_step
        if step == self.profile_step:
            strategy.pipeline_control.request_profile()
        if step == self.measure_step:
            if strategy.data_parallel != "ddp":  # the step sets them to None first: not held during it
                for p in pl_module.parameters():
                    p.grad = None
            self.result["base"] = storage_bytes(_held(pl_module, strategy.optimizers[0]))
            self._peaks = [ResidentPeak().__enter__()]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.measure_step and self._peaks:
            self._peaks[0].__exit__(None, None, None)  # the schedule's peak; the optimizer step's next
            self._peaks.append(ResidentPeak().__enter__())
        if trainer.global_step == self.measure_step + 1:
            params = list(pl_module.parameters())
            state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            grads = [p.grad for p in params if p.grad is not None]
            self.result["held"] = {"params": _size(params), "grads": _size(grads), "optim": _size(state)}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        self.losses.append(float(out["loss"] if isinstance(out, dict) else out))
        strategy, step = trainer.strategy, trainer.global_step - 1  # the step that just ran
        if step == self.profile_step:
            control = strategy.pipeline_control
            costs = control.profile_results()  # collective
            tracker = CostTracker(control.n_layers)
            tracker.update(costs)
            model = MemoryModel(tracker.layer_memory(), control.schedule, control.pp_size, control.n_microbatches,
                                control.stages_per_rank)  # fmt: skip
            self.result["predicted"] = model.peaks(control.layers_per_stage)[control.pp_rank]
        if step == self.measure_step and len(self._peaks) == 2:
            schedule, optimizer = self._peaks
            optimizer.__exit__(None, None, None)
            base = self.result["base"]
            grown = optimizer.start - schedule.start  # what the schedule left when the optimizer step began
            self.result |= {"step_peak": base + schedule.peak,
                            "with_optimizer": base + max(schedule.peak, grown + optimizer.peak)}  # fmt: skip


def _held(module: L.LightningModule, optimizer: Any) -> list[torch.Tensor]:
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [*params, *grads, *state, *module.buffers()]


def _size(tensors: list[torch.Tensor]) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    gpt_arguments(parser, layers=8, batch_help="per replica")
    # weights, gradients and optimizer state dominate (16 blocks a stage, short sequences): what sharding is for
    parser.set_defaults(layers=32, hidden=512, block=16, batch=4, steps=10)
    parser.add_argument("--out", default="docs/bench/data_parallel.json")
    args = parser.parse_args()
    serve_large_blocks_from_mappings()  # before anything is allocated: freed tensors leave the resident set at once
    model, data = gpt_config(args, n_head=8)
    names = list(MODES)
    rates: dict[str, list[float]] = {m: [] for m in names}
    memory: dict[str, list[dict[str, Any]]] = {}
    losses: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for mode in names[repeat % len(names) :] + names[: repeat % len(names)]:
            probe = StepMemory(profile_step=1, measure_step=2)
            with fit(model, data, [probe], steps=args.steps, measure_from=args.measure_from,
                     data_parallel_size=2, heartbeat_timeout=120, **MODES[mode]) as (trainer, rate):  # fmt: skip
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, {**probe.result, "pp_rank": trainer.strategy.pipeline_control.pp_rank})
            rates[mode].append(rate)
            memory.setdefault(mode, every)
            losses.setdefault(mode, probe.losses)
            if trainer.is_global_zero:
                print(f"repeat {repeat} {mode}: {rate:.0f} tokens/s", flush=True)
    if trainer.is_global_zero:
        report = _report(args, rates, memory, losses)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        shown = ("ratio_to_ddp", "step_peak_vs_ddp", "prediction_error")
        print(json.dumps({m: {k: r[k] for k in shown} for m, r in report["modes"].items()}, indent=1))


def _report(args: argparse.Namespace, rates: dict[str, list[float]], memory: dict[str, list[dict[str, Any]]],
            losses: dict[str, list[float]]) -> dict[str, Any]:  # fmt: skip
    """The results file: per mode its rates, measured and predicted peaks per rank, and losses."""
    report: dict[str, Any] = {"config": vars(args), "torch": version("torch"), "modes": {}}
    ddp_peaks = [r["step_peak"] for r in memory["ddp"]]
    for mode, ranks in memory.items():
        mean, low, high = interval95(rates[mode])
        ratio, rlow, rhigh = interval95([r / d for r, d in zip(rates[mode], rates["ddp"], strict=True)])
        measured = [r["step_peak"] for r in ranks]
        predicted = [r["predicted"] for r in ranks]
        report["modes"][mode] = {
            "settings": MODES[mode], "tokens_per_s": rates[mode], "mean": mean, "ci95": [low, high],
            "ratio_to_ddp": ratio, "ratio_ci95": [rlow, rhigh],
            "step_peak_bytes": measured, "with_optimizer_step_peak_bytes": [r["with_optimizer"] for r in ranks],
            "predicted_peak_bytes": predicted, "at_step_start_bytes": [r["base"] for r in ranks],
            "prediction_error": [p / m - 1 for p, m in zip(predicted, measured, strict=True)],
            "step_peak_vs_ddp": [r["step_peak"] / d for r, d in zip(ranks, ddp_peaks, strict=True)],
            "pp_rank": [r["pp_rank"] for r in ranks], "held_bytes_per_rank": [r.get("held") for r in ranks],
            "losses": losses[mode],
        }  # fmt: skip
    report["ddp_mean_tokens_per_s"] = interval95(rates["ddp"])[0]
    return report


if __name__ == "__main__":
    main()
