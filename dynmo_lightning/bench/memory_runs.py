"""The memory model against real training runs: FSDP2, tensor parallelism, evaluation and freezing, measured.

Real modules in real processes (the reference GPT under :class:`~dynmo_lightning.DynMoStrategy`, 4 CPU processes on
gloo), measured by the kernel, not by anything built on the model's assumptions. Per case, one ``fit`` in which:

- the prediction comes from the balancer's own path: a profiled step (``request_profile``, the strategy's
  ``profile_results``: the profiler's bytes gathered over the pipeline and its replicas, FSDP2's gradients and
  gathered weights as :meth:`~dynmo_lightning.pipeline.parallel.data_parallel.StageSharding.step_bytes` prices them),
  folded into a :class:`~dynmo_lightning.balance.CostTracker`, its ``layer_memory()`` priced by
  :class:`~dynmo_lightning.balance.steptime.memory_model.MemoryModel` under the schedule's task order, for this
  process's pipeline rank;
- the measured peak of the next step's schedule (up to the optimizer step, what the model prices) is what the
  process held when the step began, every tensor it can reach (parameters, optimizer state, receive buffers, the
  batch; DTensors' local parts: :func:`held_bytes`), plus the most its resident set grew above where it began
  (:class:`~dynmo_lightning.bench.allocations.ResidentPeak`: every thread's allocations, FSDP2's storage resizes,
  with freed blocks returned at once);
- evaluation: the peak of one validation batch (a forward-only schedule, after training), measured the same way,
  beside the training step's prediction, which is what the planner checks a capacity against;
- freezing: the step measured after a prefix of the layers froze (``LayerFreezing``, schedule mode), beside the
  prediction from a step profiled after the freeze, as the balancer re-measures changed layers.

``python -m dynmo_lightning.bench.memory`` runs it (:func:`real_rows`) for ``docs/bench/memory_model.json``.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from dynmo_lightning.balance import CostTracker
from dynmo_lightning.balance.steptime.memory_model import MemoryModel
from dynmo_lightning.bench.allocations import ResidentPeak, serve_large_blocks_from_mappings, storage_bytes
from dynmo_lightning.launch import run_ranks

#: Processes of every case.
WORLD = 4
#: The reference GPT of every case: 8 blocks of 256 (fp32), sequences of 128, 8 sequences a replica, 4 micro-batches.
GPT = {"n_layer": 8, "n_embd": 256, "n_head": 4, "block_size": 128, "vocab_size": 256, "tie_embeddings": False}
BATCH, MICROBATCHES = 8, 4
#: Frozen prefix of the freezing case (embedding and three blocks, frozen from step :data:`FREEZE_AT` on).
FROZEN, FREEZE_AT = 4, 4
#: Steps of every case, and the validation batches after the last.
STEPS, VALIDATION = 8, 2

#: Every case by its key: the strategy's settings (``freezing``: P = 4 alone, measured before and after a prefix
#: froze).
CASES: dict[str, dict[str, Any]] = {
    "fsdp": {"data_parallel_size": 2, "data_parallel": "fsdp"},
    "fsdp_memory=lean": {"data_parallel_size": 2, "data_parallel": "fsdp", "fsdp_memory": "lean"},
    "tensor_parallel": {"tensor_parallel_size": 2},
    "freezing": {},
}
#: The kind of a row by its case and window (the freezing case's first window is a plain pipeline).
_KINDS = {("freezing", "training"): "pipeline", ("freezing", "frozen"): "freezing"}


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages of every tensor this process holds (DTensors' local parts, a storage once).

    All the interpreter can reach, and the module's gradients (a parameter's gradient has no Python object until
    it is read).
    """
    gc.collect()
    reachable = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return storage_bytes([*reachable, *grads])


class StepMemory(L.Callback):
    """The model's prediction and the measured peak of a training step, and of evaluation.

    A peak is measured on several steps (validation batches) alike and the least kept: what a process adds on top
    of its tensors only now and then (a page of a library's code read back in, a heap that grew) is not the
    step's.

    Args:
        windows: ``(label, profiled step, measured steps)``: the prediction from the profiled step, the peak of
            the measured ones (later steps).
    """

    def __init__(self, windows: Iterable[tuple[str, int, tuple[int, ...]]]) -> None:
        self.windows = list(windows)
        self.results: dict[str, dict[str, Any]] = {}
        self._open: tuple[str, int, ResidentPeak] | None = None

    def _profiled(self, step: int) -> str | None:
        return next((label for label, profiled, _ in self.windows if profiled == step), None)

    def _measured(self, step: int) -> str | None:
        return next((label for label, _, measured in self.windows if step in measured), None)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Profile a window's profiled step; open the measurement of a measured one (from what the process holds)."""
        control, step = trainer.strategy.pipeline_control, trainer.global_step
        if self._profiled(step) is not None:
            control.request_profile()
        label = self._measured(step)
        if label is not None:
            if control.data_parallel != "ddp" or control.dp_size == 1:  # not in DDP's buckets: the step sets
                # them to None first, and they are not held until it makes them again
                for p in pl_module.parameters():
                    p.grad = None
            self._open = (label, held_bytes(pl_module), ResidentPeak().__enter__())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Close the measurement at the end of the step's schedule (what the model prices, not the optimizer's)."""
        self._close()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """After a profiled step: the model's prediction from its measurements (collective)."""
        label = self._profiled(trainer.global_step - 1)  # the step that just ran
        if label is not None:
            self.results.setdefault(label, {})["predicted"] = _predicted(trainer.strategy)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int,
                                  dataloader_idx: int = 0) -> None:  # fmt: skip
        """Open the measurement of a validation batch."""
        self._open = ("evaluation", held_bytes(pl_module), ResidentPeak().__enter__())

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, batch: Any,
                                idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        """Close the validation batch's measurement."""
        self._close()

    def _close(self) -> None:
        if self._open is None:
            return
        label, base, peak = self._open
        peak.__exit__(None, None, None)
        got = self.results.setdefault(label, {})
        if base + peak.peak < got.get("measured", math.inf):
            got.update({"measured": base + peak.peak, "held_at_start": base})
        self._open = None


def _predicted(strategy: Any) -> float:
    """This process's predicted peak from the step just profiled, as the balancer prices it (collective)."""
    control = strategy.pipeline_control
    tracker = CostTracker(control.n_layers)
    tracker.update(control.profile_results())
    model = MemoryModel(tracker.layer_memory(), control.schedule, control.pp_size, control.n_microbatches,
                        control.stages_per_rank)  # fmt: skip
    return model.peaks(control.layers_per_stage)[control.pp_rank]


def _windows(case: str) -> list[tuple[str, int, tuple[int, ...]]]:
    """Step 0 builds the stages; under freezing the prefix freezes after step 3, and step 4 builds them again."""
    if case == "freezing":
        return [("training", 1, (2, 3)), ("frozen", FREEZE_AT + 1, (FREEZE_AT + 2, FREEZE_AT + 3))]
    return [("training", 1, (2, 3))]


def _fit(case: str) -> dict[str, Any]:
    """One case's ``fit`` in a world of its own; returns this process's results."""
    from dynmo_lightning import DynMoStrategy
    from dynmo_lightning.callbacks.freezing import LayerFreezing
    from dynmo_lightning.launch import fresh_world
    from dynmo_lightning.models import GPT as Model

    torch.manual_seed(0)
    model = Model(**GPT)
    ids = torch.randint(0, GPT["vocab_size"], (BATCH * STEPS * 2, GPT["block_size"]))
    data = torch.utils.data.TensorDataset(ids, ids.roll(-1, dims=1))
    probe = StepMemory(_windows(case))
    callbacks: list[L.Callback] = [probe]
    if case == "freezing":
        callbacks.append(LayerFreezing(mode="schedule", start_step=0, schedule=dict.fromkeys(range(FROZEN), FREEZE_AT)))
    with fresh_world():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=DynMoStrategy(n_microbatches=MICROBATCHES, heartbeat_timeout=120, **CASES[case]),
            max_steps=STEPS,
            val_check_interval=STEPS,
            check_val_every_n_epoch=None,
            limit_val_batches=VALIDATION,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
        trainer.fit(model, loader, loader)
        control = trainer.strategy.pipeline_control
        return {"case": case, "rank": trainer.global_rank, "pp_rank": control.pp_rank, "pp_size": control.pp_size,
                "layers_per_stage": control.layers_per_stage, "schedule": control.schedule,
                "results": probe.results}  # fmt: skip


def main() -> None:
    """A rank of :func:`real_rows`' launch: ``python -m dynmo_lightning.bench.memory_runs OUT_DIR [CASE ...]``."""
    out, cases = Path(sys.argv[1]), sys.argv[2:] or list(CASES)
    serve_large_blocks_from_mappings()  # before anything is allocated: freed tensors leave the resident set at once
    for case in cases:
        result = _fit(case)
        (out / f"{case}.rank{result['rank']}.json").write_text(json.dumps(result))


def real_rows(work_dir: Path, cases: Iterable[str] = tuple(CASES), timeout: float = 1200) -> list[dict[str, Any]]:
    """Launch every case on :data:`WORLD` processes; one row per process and measured window.

    Rows: ``case``, ``kind`` (the case's key, or ``evaluation``), ``stage`` (the pipeline rank), ``process``,
    ``predicted_bytes``, ``measured_bytes``, ``relative_error`` (predicted over measured, less one), ``truth``,
    ``layers_per_stage``.
    """
    cases = list(cases)
    work_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "dynmo_lightning.bench.memory_runs", str(work_dir), *cases]
    codes = run_ranks(WORLD, argv, log_dir=work_dir, tag="memory_runs", timeout=timeout)
    if any(c != 0 for c in codes):
        logs = "\n".join((work_dir / f"memory_runs.rank{r}.log").read_text()[-3000:] for r in range(WORLD))
        raise RuntimeError(f"the real memory runs failed (exit codes {codes}):\n{logs}")
    rows = []
    for case in cases:
        for rank in range(WORLD):
            rows.extend(_rows(json.loads((work_dir / f"{case}.rank{rank}.json").read_text())))
    return rows


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    case, results = result["case"], result["results"]
    settings = CASES[case]
    shape = f"P={result['pp_size']}" + "".join(f" {k}={v}" for k, v in settings.items())
    model = f"gpt {GPT['n_layer']}x{GPT['n_embd']} seq {GPT['block_size']}"
    rows = []
    for label, got in results.items():
        predicted = got.get("predicted", results["training"]["predicted"])  # evaluation: the training step's
        kind = "evaluation" if label == "evaluation" else _KINDS.get((case, label), case)
        name = f"{model} {shape} {result['schedule']} M={MICROBATCHES}"
        name += {"training": "", "frozen": f" ({FROZEN} layers frozen)", "evaluation": " evaluation"}[label]
        rows.append({"case": name, "model": model, "kind": kind,
                     "schedule": result["schedule"], "ranks": result["pp_size"], "n_microbatches": MICROBATCHES,
                     "activation_checkpointing": False, "stage": result["pp_rank"], "process": result["rank"],
                     "layers_per_stage": result["layers_per_stage"], "predicted_bytes": int(predicted),
                     "measured_bytes": int(got["measured"]), "relative_error": predicted / got["measured"] - 1,
                     "truth": "resident set of a real process"})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
