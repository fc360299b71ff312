"""The prepared GPU check: one command, one JSON summary (also runs on CPU, the same code path).

    python examples/gpu_check.py                       # on the GPU (CUDA), under 8 minutes on one GPU
    python examples/gpu_check.py --device cpu --quick  # the same path on CPU (what the test suite runs)

It reports, per dynamic (the presets of ``dynmo_lightning.bench.timeline``):

- training on the device (P = 1) against the same training on CPU: the per-step losses and their largest relative
  difference;
- host synchronisations per training step: calls of ``Tensor.item/tolist/__bool__/__int__/__float__`` counted from
  Python (every device), plus on CUDA the syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports;
- DynMo's layer profiler against ``torch.profiler`` on one step: the profiled layers' total time over the step's
  time as ``torch.profiler`` saw it (a share, at most 1);

and, with two or more GPUs, a P = 2 pipeline over NCCL against P = 1; and the layer cost table of the performance
benchmark (``dynmo_lightning.bench.layer_costs``) measured on the device (``--quick``: a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.bench import layer_costs
from dynmo_lightning.bench.timeline import PRESETS, Losses
from dynmo_lightning.callbacks import HostSyncCounter
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import run_ranks
from dynmo_lightning.models import GPT


class ProfilerCheck(L.Callback):
    """On one step: DynMo's per-layer profile and ``torch.profiler`` side by side."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.result: dict[str, float] = {}
        self._prof: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Start both profilers on the chosen step."""
        if trainer.global_step == self.step:
            trainer.strategy.request_profile()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Compare: the layers' profiled time is a share of the step's."""
        if self._prof is None:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        layers = trainer.strategy.profile_results() or {}
        profiled = sum(c["fwd"] + c["bwd"] for c in layers.values())
        events = self._prof.key_averages()
        torch_total = max((e.cpu_time_total for e in events), default=0.0) / 1e6  # the outermost span, seconds
        self.result = {"layers_s": profiled, "step_wall_s": wall, "torch_profiler_s": torch_total,
                       "layers_share_of_step": profiled / wall if wall else math.nan}  # fmt: skip
        self._prof = None


def train(dynamic: str, device: str, steps: int, quick: bool, devices: int = 1) -> dict[str, Any]:
    """Train the check's GPT with ``dynamic`` (its preset) on ``device``; losses, syncs and the profiler check."""
    L.seed_everything(0)
    n_blocks = 4 if quick else 8
    model = GPT(n_layer=n_blocks, n_embd=64 if quick else 256, n_head=4, block_size=64 if quick else 256,
                warmup_steps=0, tie_embeddings=False, init_seed=0)  # fmt: skip
    losses, syncs, prof = Losses(), HostSyncCounter(device == "cuda"), ProfilerCheck(step=steps - 2)
    callbacks: list[L.Callback] = [losses, syncs, prof]
    if dynamic != "none":
        preset = PRESETS[dynamic]
        callbacks.insert(0, preset.make(preset.preset, steps, n_blocks))
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=devices, max_steps=steps,
                        strategy=DynMoStrategy(n_microbatches=2), callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, deterministic="warn")  # fmt: skip
    data = StdlibCharDataModule(block_size=model.hparams.block_size, batch_size=8, max_bytes=400_000, seed=0)
    with syncs.patched():
        trainer.fit(model, datamodule=data)
    return {"losses": losses.values, "syncs_per_step": syncs.counts[1:], "optimizer_syncs": syncs.optimizer_counts[1:],
            "profiler": prof.result}  # fmt: skip


def _rel(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=math.nan)


def pipeline_check(device: str, steps: int, quick: bool) -> dict[str, Any]:
    """P = 2 (NCCL on two GPUs, gloo on CPU) against P = 1, in two fresh processes."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p2.json"
        argv = [sys.executable, __file__, "--worker", str(out), "--device", device, "--steps", str(steps)]
        codes = run_ranks(2, [*argv, *(["--quick"] if quick else [])], log_dir=Path(d), tag="p2", timeout=600)
        if any(c != 0 for c in codes):
            logs = "".join((Path(d) / f"p2.rank{r}.log").read_text()[-2000:] for r in range(2))
            return {"ok": False, "exit_codes": codes, "log": logs}
        return {"ok": True, **json.loads(out.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="a tiny model and layer-cost shape (CPU, tests)")
    parser.add_argument("--dynamics", default=",".join(["none", *PRESETS]))
    parser.add_argument("--pipeline", action="store_true", help="also P = 2 (default: with two or more GPUs)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one rank of the P = 2 check
        result = train("none", args.device, args.steps, args.quick, devices=2)
        if torch.distributed.get_rank() == 0:
            Path(args.worker).write_text(json.dumps(result))
        return
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "dynamics": {}}
    if args.device == "cuda":
        summary["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for dynamic in args.dynamics.split(","):
        on_device = train(dynamic, args.device, args.steps, args.quick)
        entry = {"syncs_per_step": max(on_device["syncs_per_step"], default=0),
                 "of_which_optimizer_step": max(on_device["optimizer_syncs"], default=0),
                 "profiler": on_device["profiler"]}  # fmt: skip
        if args.device != "cpu":
            reference = train(dynamic, "cpu", args.steps, args.quick)
            entry["max_rel_loss_diff_vs_cpu"] = _rel(on_device["losses"], reference["losses"])
        entry["final_loss"] = on_device["losses"][-1]
        summary["dynamics"][dynamic] = entry
        print(f"[gpu check] {dynamic}: {json.dumps(entry)}", flush=True)
    if args.pipeline or (args.device == "cuda" and torch.cuda.device_count() >= 2):
        p2 = pipeline_check(args.device, args.steps, args.quick)
        if p2.get("ok"):
            p1 = train("none", args.device, args.steps, args.quick)
            p2 = {"ok": True, "max_rel_loss_diff_vs_p1": _rel(p2["losses"], p1["losses"])}
        summary["pipeline_p2"] = p2
    shape = layer_costs.LayerShape(hidden=32, heads=2, seq=32, vocab=64, n_experts=4, attn_block=8) if args.quick else \
        layer_costs.LayerShape()  # fmt: skip
    table = layer_costs.measure(shape, device=args.device, min_run_time=0.01 if args.quick else 0.5)
    summary["layer_costs"] = {"shape": table["shape"], "block": table["block"], "machine": table["machine"]}
    summary["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "layer_costs"}, indent=1))


if __name__ == "__main__":
    main()
