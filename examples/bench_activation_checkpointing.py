"""Activation memory per pipeline stage with and without activation checkpointing (CPU, 2 processes).

Run (about 5 minutes on 2 cores; launches its own CPU ranks with ``dynmo_lightning.launch``):
    python examples/bench_activation_checkpointing.py --out docs/bench/activation_checkpointing.json

The reference GPT at a size where activations dominate (8 blocks of width 128, sequences of 1,024 tokens, a batch of
8 in 4 micro-batches, 1F1B), trained a few steps under ``DynMoStrategy`` at P = 2 with
``activation_checkpointing`` off, every second pipeline layer (``2``) and every layer (``"all"``), each in fresh
processes. Per stage, two measurements of different kinds:

* **measured peak**: the most bytes of tensor storage allocated during one (unprofiled) training step and alive at
  once, above what was alive when the step began: forward and backward of all micro-batches, recomputations,
  gradients, the optimizer step. Every storage an operator creates is seen by a ``TorchDispatchMode`` and counted
  until it is freed (CPU has no ``torch.cuda.max_memory_allocated``; on a GPU that is the number to read);
* **profiled**: what the profiler reports to the balancer for a profiled step: activation bytes per micro-batch
  (what the stage's layers keep for backward), times the micro-batches stage ``s`` holds at once under 1F1B
  (``min(M, P - s)``: 2 on the first stage, 1 on the last), plus the largest recomputation of one checkpointed layer
  (``recompute_bytes``; one runs at a time).

Losses of the three runs are equal (checkpointing does not change the math); they are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import weakref
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CASES = {"off": None, "every 2nd layer": 2, "all": "all"}


class PeakTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while the mode is on and not yet freed, and their peak.

    A storage an operator returns that none of its inputs holds (not a view, not written in place) is new: it counts
    from then until its last reference goes (a finaliser on the storage, which Python keeps one object of).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        held = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if id(storage) in held or storage in self._counted:
                continue
            self._counted.add(storage)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


class Measure(L.Callback):
    """Profiles step ``profile_step`` (collective) and tracks the tensor bytes of step ``peak_step``."""

    def __init__(self, profile_step: int, peak_step: int) -> None:
        self.profile_step, self.peak_step = profile_step, peak_step
        self.costs: dict[int, dict[str, float]] = {}
        self.peak = 0
        self.losses: list[float] = []
        self._mode: PeakTensorBytes | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        if trainer.global_step == self.profile_step:
            trainer.strategy.pipeline_control.request_profile()
        if trainer.global_step == self.peak_step:
            self._mode = PeakTensorBytes()
            self._mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.peak, self._mode = self._mode.peak, None
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step - 1 == self.profile_step:
            self.costs = trainer.strategy.pipeline_control.profile_results()


def worker(case: str, args: argparse.Namespace, work: Path) -> None:
    """Train under DynMoStrategy with the case's setting (one rank of the job); write this rank's report."""
    from dynmo_lightning import DynMoStrategy
    from dynmo_lightning.data import StdlibCharDataModule
    from dynmo_lightning.models import GPT

    L.seed_everything(0)
    measure = Measure(profile_step=1, peak_step=2)
    strategy = DynMoStrategy(n_microbatches=args.microbatches, activation_checkpointing=CASES[case], timeout=600)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=3,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    model = GPT(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq, tie_embeddings=False)
    data = StdlibCharDataModule(block_size=args.seq, batch_size=args.batch, max_bytes=2_000_000)
    trainer.fit(model, datamodule=data)
    rank = trainer.global_rank
    start = sum(strategy.pipeline_control.layers_per_stage[:rank])
    layers = range(start, start + strategy.pipeline_control.layers_per_stage[rank])
    costs = [measure.costs[i] for i in layers]
    inflight = min(
        args.microbatches, strategy.pipeline_control.pp_size - rank
    )  # 1F1B: stage s holds P - s micro-batches at most
    report = {
        "stage": rank,
        "layers": list(layers),
        "measured_peak_bytes": measure.peak,
        "activation_bytes_per_microbatch": sum(c["activation_bytes"] for c in costs),
        "largest_recompute_bytes": max(c["recompute_bytes"] for c in costs),
        "inflight_microbatches": inflight,
        "profiled_bytes": inflight * sum(c["activation_bytes"] for c in costs)
        + max(c["recompute_bytes"] for c in costs),
        "static_bytes": sum(c["param_bytes"] + c["grad_bytes"] + c["optim_bytes"] for c in costs),
        "losses": measure.losses,
    }
    (work / f"{case}.rank{rank}.json").write_text(json.dumps(report))


def launch(case: str, argv: list[str], work: Path, processes: int) -> list[dict[str, Any]]:
    """Run ``case`` in ``processes`` fresh processes; their reports, by rank."""
    from dynmo_lightning.launch import run_ranks

    tag = case.replace(" ", "_")
    codes = run_ranks(processes, [*argv, "--worker", case, "--work", str(work)], log_dir=work, tag=tag, timeout=1800)
    if any(c != 0 for c in codes):
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(work.glob(f"{tag}.rank*.log")))
        raise SystemExit(f"{case} failed (exit codes {codes}):\n{logs}")
    return [json.loads((work / f"{case}.rank{r}.json").read_text()) for r in range(processes)]


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table of docs/activation_checkpointing.md."""
    mib = 2**20
    rows = [
        "| setting | stage | layers | measured peak (MiB) | profiled activations (MiB) | per micro-batch (MiB) "
        "| largest recomputation (MiB) | parameters, gradients, Adam (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, reports in runs.items():
        for r in reports:
            rows.append(
                f"| `{CASES[case]!r}` | {r['stage']} | {r['layers'][0]}-{r['layers'][-1]} "
                f"| {r['measured_peak_bytes'] / mib:.1f} | {r['profiled_bytes'] / mib:.1f} "
                f"| {r['activation_bytes_per_microbatch'] / mib:.1f} | {r['largest_recompute_bytes'] / mib:.1f} "
                f"| {r['static_bytes'] / mib:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", default="activation_checkpointing.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        torch.set_num_threads(1)  # two ranks on two cores
        worker(args.worker, args, Path(args.work))
        return
    sizes = [f"--{k}={getattr(args, k)}" for k in ("layers", "embd", "heads", "seq", "batch", "microbatches")]
    work = Path(tempfile.mkdtemp(prefix="dynmo-actckpt-"))
    try:
        runs = {case: launch(case, [sys.executable, __file__, *sizes], work, args.processes) for case in CASES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    losses = {case: reports[-1]["losses"] for case, reports in runs.items()}
    result = {
        "command": " ".join(["python", *sys.argv]),
        "model": {"n_layer": args.layers, "n_embd": args.embd, "n_head": args.heads, "block_size": args.seq},
        "batch_size": args.batch,
        "n_microbatches": args.microbatches,
        "schedule": "1f1b",
        "processes": args.processes,
        "losses_equal": all(v == losses["off"] for v in losses.values()),
        "runs": {case: {"setting": CASES[case], "stages": reports} for case, reports in runs.items()},
        "table": table(runs),
        "versions": {p: version(p) for p in ("torch", "lightning")},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["table"])
    print(f"losses equal across settings: {result['losses_equal']}")


if __name__ == "__main__":
    main()
