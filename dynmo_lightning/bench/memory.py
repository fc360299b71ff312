"""Every stage's memory at real sizes without a GPU: the schedule's own task order run on fake tensors, tracked.

One truth the memory model (:mod:`dynmo_lightning.balance.steptime.memory_model`) is checked against (the other is
real processes: :mod:`~dynmo_lightning.bench.memory_runs`). For one pipeline rank at a time, its stages are built at
full size under ``FakeTensorMode`` (fake CPU tensors: nothing is allocated; byte counts do not depend on the device),
with the receive buffers torch's ``PipelineStage`` keeps (one input and one output-gradient buffer per micro-batch)
and AdamW with its state; then one training step runs the rank's tasks in the order of the schedule
(:func:`~dynmo_lightning.balance.steptime.makespan.rank_orders`) with torch's own backward functions
(``stage_backward``, and ``stage_backward_input`` / ``stage_backward_weight`` for the zero-bubble schedules' split
backward), the stage keeping every micro-batch's output until its backward as torch's does, and the optimizer step;
torch's ``MemTracker`` reports the peak. Layers run through the project's
:class:`~dynmo_lightning.pipeline.stage.slots.StageModule`, so activation checkpointing is the runtime's. Under FSDP2
(:class:`Sharded`) the process is one replica of a fake process group: its layers are real units over it, driven as
the pipeline stage drives them (gradient sync off until the reduction after the last backward, or every micro-batch
reducing under ``fsdp_memory="lean"``).

The same layers measured one at a time (:func:`layer_bytes`, with the project's profiler) give the model its inputs:
parameters, gradients, optimizer state, what a layer keeps for backward per micro-batch, its input's and output's
sizes, and what its backward holds at its peak (measured here: the balancer's own path has no such measurement).

The pieces: the models as the emulator builds them (:mod:`~dynmo_lightning.bench.memory_stacks`), its fake tensors,
fake process group and stages (:mod:`~dynmo_lightning.bench.memory_emulator`), every layer measured alone
(:mod:`~dynmo_lightning.bench.memory_layers`) and a rank's whole step (:mod:`~dynmo_lightning.bench.memory_step`);
this module compares them over the committed table's cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dynmo_lightning.balance.steptime.memory_model import MemoryModel, additive
from dynmo_lightning.bench.memory_emulator import Sharded
from dynmo_lightning.bench.memory_layers import layer_bytes
from dynmo_lightning.bench.memory_stacks import Stack, gpt_stack, llama_stack
from dynmo_lightning.bench.memory_step import tracked_peaks

__all__ = [
    "BOUNDS",
    "EMULATED",
    "FSDP_CASES",
    "MODELS",
    "SCHEDULE_CASES",
    "Sharded",
    "Stack",
    "bound",
    "compare",
    "gpt_stack",
    "layer_bytes",
    "llama_stack",
    "main",
    "real_table",
    "table",
    "tracked_peaks",
    "uniform",
    "within",
]


#: The models of the committed table (bf16-mixed, AdamW, micro-batches of one sequence).
MODELS: dict[str, Callable[[], Stack]] = {
    "gpt_1b": lambda: gpt_stack(n_layer=22, n_embd=2048, n_head=16, seq=2048, vocab=50304, autocast=True),
    "llama_7b": lambda: llama_stack(32, 4096, 11008, 32, 32, 32000, 4096),
}


#: ``(schedule, stages per rank, activation checkpointing)`` of the committed table (checkpointing does not run
#: under the split backward).
SCHEDULE_CASES = (("1f1b", 1, False), ("1f1b", 1, True), ("gpipe", 1, False), ("gpipe", 1, True), ("zbv", 2, False))


#: FSDP2 in every stage (1F1B), both ``fsdp_memory`` settings, by model: ``(pipeline ranks, replicas)``.
FSDP_CASES: dict[str, tuple[int, int]] = {"gpt_1b": (4, 8), "llama_7b": (8, 8)}


#: What a row's prediction must be within, relative to its measurement (``predicted / measured - 1``), by the kind
#: of row: the model given measured layers (MemTracker on fake tensors) is exact but for a few KiB of the step's
#: own small tensors, never under by more than 1 %; the lean way prices a layer's gathered weights, whole gradient
#: and reduce-scatter buffers on top of its backward's own peak, which do not all coincide (over, by up to a large
#: head's); real processes priced from the balancer's path (the profiler's bytes: no backward workspace, no
#: forward transient, no loss) within 15 %, and evaluation's peak at most the training step's prediction (what a
#: capacity is checked against).
BOUNDS: dict[str, tuple[float, float]] = {
    "emulated": (-0.01, 0.10),
    "emulated fsdp_memory=lean": (-0.01, 0.25),
    "real": (-0.15, 0.15),
    "real evaluation": (0.0, math.inf),
}


def bound(row: dict[str, Any]) -> tuple[float, float]:
    """The interval :data:`BOUNDS` gives ``row``'s relative error."""
    emulated = row["truth"] == EMULATED
    if emulated:
        return BOUNDS["emulated fsdp_memory=lean" if row["kind"] == "fsdp_memory=lean" else "emulated"]
    return BOUNDS["real evaluation" if row["kind"] == "evaluation" else "real"]


def within(row: dict[str, Any]) -> bool:
    """Whether ``row``'s prediction is within its :func:`bound`."""
    low, high = bound(row)
    return low <= row["relative_error"] <= high


#: The ``truth`` of the rows measured here (the real runs' is :mod:`~dynmo_lightning.bench.memory_runs`').
EMULATED = "MemTracker on fake tensors"


def uniform(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage of the uniform split (as ``partition="uniform"``: the first stages take the remainder)."""
    return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]


def compare(
    stack: Stack,
    ranks: int,
    schedule: str,
    stages_per_rank: int,
    recompute: bool,
    n_microbatches: int,
    sharded: Sharded | None = None,
) -> list[dict[str, Any]]:
    """Per rank: the model's predicted peak, the tracked peak and the old per-layer sum, for the uniform split."""
    split = uniform(stack.n_layers, ranks * stages_per_rank)
    layers = layer_bytes(stack, recompute, sharded)
    model = MemoryModel(layers, schedule, ranks, n_microbatches, stages_per_rank)
    predicted = model.peaks(split)
    tracked = tracked_peaks(stack, split, schedule, n_microbatches, stages_per_rank, recompute, sharded)
    summed = additive(layers, max(model.inflight()))
    starts = [sum(split[:s]) for s in range(len(split) + 1)]
    old = [sum(summed[starts[s] : starts[s + 1]]) for s in range(len(split))]
    per_rank = [sum(old[s] for s, r in enumerate(model.ranks) if r == rank) for rank in range(ranks)]
    rows = []
    for r, (p, t, o) in enumerate(zip(predicted, tracked, per_rank, strict=True)):
        rows.append({"stage": r, "predicted_bytes": int(p), "measured_bytes": int(t), "per_layer_sum_bytes": int(o),
                     "relative_error": p / t - 1})  # fmt: skip
    return rows


def table(models: Sequence[str] = tuple(MODELS), ranks: Sequence[int] = (4, 8)) -> list[dict[str, Any]]:
    """Rows ``{case, kind, stage, predicted_bytes, measured_bytes, ...}`` of every model, size, schedule and FSDP case.

    Cases: every pipeline size of ``ranks`` under every schedule of :data:`SCHEDULE_CASES`, and :data:`FSDP_CASES`.
    """
    rows = []
    for name in models:
        stack = MODELS[name]()
        cases = [(p, schedule, spr, recompute, None) for p in ranks for schedule, spr, recompute in SCHEDULE_CASES]
        if name in FSDP_CASES:
            p, d = FSDP_CASES[name]
            cases += [(p, "1f1b", 1, False, Sharded(d, lean)) for lean in (False, True)]
        for p, schedule, spr, recompute, sharded in cases:
            m = 2 * p
            kind = "schedule" if sharded is None else "fsdp_memory=lean" if sharded.lean else "fsdp"
            case = f"{name} P={p} {schedule}{' AC' if recompute else ''} M={m}"
            case += "" if sharded is None else f" D={sharded.replicas} {kind}"
            for row in compare(stack, p, schedule, spr, recompute, m, sharded):
                rows.append({"case": case, "model": name, "kind": kind, "ranks": p, "schedule": schedule,
                             "activation_checkpointing": recompute, "n_microbatches": m,
                             "replicas": 1 if sharded is None else sharded.replicas, "truth": EMULATED,
                             **row})  # fmt: skip
            errors = [f"{r['relative_error']:+.1%}" for r in rows if r["case"] == case]
            print(f"{case}: {' '.join(errors)}", flush=True)
    return rows


def real_table(work_dir: Path) -> list[dict[str, Any]]:
    """The real processes' rows (:func:`~dynmo_lightning.bench.memory_runs.real_rows`), the plain ones emulated too.

    A plain pipeline row (``kind="pipeline"``) also holds ``emulated_bytes`` (MemTracker's peak of the same step on
    fake tensors: fp32, the same shapes, split and schedule) and ``predicted_from_measured_layers_bytes`` (the model
    given every layer measured alone, its backward's workspace included): they tell what the balancer's path lacks
    from what a real process holds beyond its tensors.
    """
    from dynmo_lightning.bench import memory_runs as runs

    rows = runs.real_rows(work_dir)
    plain = [r for r in rows if r["kind"] == "pipeline"]
    if plain:
        gpt, split = runs.GPT, plain[0]["layers_per_stage"]
        stack = gpt_stack(gpt["n_layer"], gpt["n_embd"], gpt["n_head"], gpt["block_size"], gpt["vocab_size"],
                          microbatch=runs.BATCH // runs.MICROBATCHES)  # fmt: skip
        predicted = MemoryModel(layer_bytes(stack), "1f1b", len(split), runs.MICROBATCHES).peaks(split)
        tracked = tracked_peaks(stack, split, "1f1b", runs.MICROBATCHES)
        for row in plain:
            row["predicted_from_measured_layers_bytes"] = int(predicted[row["stage"]])
            row["emulated_bytes"] = tracked[row["stage"]]
    return rows


def main() -> None:
    """``python -m dynmo_lightning.bench.memory --out docs/bench/memory_model.json`` (about 40 minutes on 2 cores).

    The rows measured on fake tensors (:func:`table`), then those of real processes
    (:func:`real_table`: 4 processes, about 3 minutes; ``--no-real`` skips them).
    """
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default="docs/bench/memory_model.json")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--no-real", action="store_true", help="only the rows measured on fake tensors")
    args = parser.parse_args()
    rows = table(args.models.split(","), [int(r) for r in args.ranks.split(",")])
    if not args.no_real:
        with tempfile.TemporaryDirectory() as work:
            rows += real_table(Path(work))
    outside = [r for r in rows if not within(r)]
    worst = max(abs(r["relative_error"]) for r in rows if r["truth"] == EMULATED)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "bounds": {k: list(v) for k, v in BOUNDS.items()}, "outside_bounds": len(outside),
                   "max_abs_relative_error_emulated": worst, "torch": torch.__version__}, f, indent=1)  # fmt: skip
    print(f"{len(rows)} rows, {len(outside)} outside their bounds, emulated |predicted / measured - 1| <= {worst:.3f}")


if __name__ == "__main__":
    main()
