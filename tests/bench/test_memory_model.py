"""The memory model against what is measured, and planning a 7B-shaped model within a capacity.

- Small rows rebuilt here, in this process (the fast lane): a 4-block GPT under bf16 autocast, P = 2, on fake
  tensors (``dynmo_lightning.bench.memory``): every layer measured alone gives the model its inputs, torch's
  ``MemTracker`` follows one training step in the schedule's task order; 1F1B and GPipe with and without activation
  checkpointing, ZBV, and FSDP2 over a fake process group of 2 in both ``fsdp_memory`` settings.
- The committed table (``docs/bench/memory_model.json``: 1B and 7B shapes, and real processes): every case there,
  every row within its bound (``bench.memory.BOUNDS``).
- Real processes (the slow lane): FSDP2 and tensor parallelism, 4 CPU processes on gloo, measured by the kernel and
  predicted from the balancer's own path (``dynmo_lightning.bench.memory_runs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmo_lightning.balance.steptime.memory_model import MemoryCheck, MemoryModel, additive
from dynmo_lightning.balance.steptime.planner import StepModel, makespan_split
from dynmo_lightning.bench.memory import (
    EMULATED,
    FSDP_CASES,
    MODELS,
    SCHEDULE_CASES,
    Sharded,
    compare,
    gpt_stack,
    layer_bytes,
    within,
)
from dynmo_lightning.bench.memory_runs import CASES, real_rows

TABLE = Path(__file__).resolve().parents[2] / "docs" / "bench" / "memory_model.json"
GiB = 2**30


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "spr", "recompute", "sharded"), [
    ("1f1b", 1, False, None), ("1f1b", 1, True, None), ("gpipe", 1, True, None), ("zbv", 2, False, None),
    ("1f1b", 1, False, Sharded(2)), ("1f1b", 1, False, Sharded(2, lean=True)),
])  # fmt: skip
def test_small_rows_recomputed_here_are_within_their_bound(schedule, spr, recompute, sharded):
    stack = gpt_stack(n_layer=4, n_embd=128, n_head=4, seq=128, vocab=512, microbatch=2, autocast=True)
    kind = "schedule" if sharded is None else "fsdp_memory=lean" if sharded.lean else "fsdp"
    rows = [{"truth": EMULATED, "kind": kind, **row} for row in compare(stack, 2, schedule, spr, recompute, 4, sharded)]
    assert len(rows) == 2
    errors = [f"stage {r['stage']}: {r['relative_error']:+.2%}" for r in rows]
    assert all(within(r) for r in rows), errors


def test_the_committed_table_is_complete_and_every_row_within_its_bound():
    table = json.loads(TABLE.read_text())
    rows = table["rows"]
    emulated = {(r["model"], r["ranks"], r["schedule"], r["activation_checkpointing"], r["kind"]) for r in rows
                if r["truth"] == EMULATED}  # fmt: skip
    wanted = {(m, p, s, ac, "schedule") for m in MODELS for p in (4, 8) for s, _, ac in SCHEDULE_CASES}
    wanted |= {(m, p, "1f1b", False, k) for m, (p, _) in FSDP_CASES.items() for k in ("fsdp", "fsdp_memory=lean")}
    assert emulated == wanted
    assert {r["case"] for r in rows if r["model"] == "llama_7b" and r["ranks"] == 8}  # the 7B shape at P = 8
    real = [r for r in rows if r["truth"] != EMULATED]
    assert {r["kind"] for r in real} == {*CASES, "pipeline", "evaluation"}  # the freezing case starts plain
    assert len({r["process"] for r in real}) == 4  # every process of the real runs
    assert [r for r in rows if not within(r)] == []
    assert table["outside_bounds"] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_processes_under_fsdp_and_tensor_parallelism_are_within_their_bound(tmp_path: Path) -> None:
    rows = real_rows(tmp_path, ["fsdp", "tensor_parallel"])
    kinds = ("fsdp", "tensor_parallel", "evaluation")
    assert {(r["kind"], r["process"]) for r in rows} == {(k, p) for k in kinds for p in range(4)}
    outside = [(r["kind"], r["process"], f"{r['relative_error']:+.2%}") for r in rows if not within(r)]
    assert outside == []


@pytest.mark.timeout(300)
def test_planning_the_7b_shape_checks_the_schedules_peak_not_the_per_layer_sum():
    layers = layer_bytes(MODELS["llama_7b"]())  # 34 layers: embedding, 32 decoder layers, head
    split = [5, 4, 4, 4, 4, 4, 4, 5]
    capacity = [44 * GiB] + [48 * GiB] * 7  # the first GPU has less room (it shares the node's other work)
    # The per-layer sum (every stage holding min(M, P) micro-batches, nothing else) accepts the split ...
    summed = additive(layers, inflight=8)
    starts = [sum(split[:s]) for s in range(9)]
    per_stage = [sum(summed[starts[s] : starts[s + 1]]) for s in range(8)]
    assert all(b <= c for b, c in zip(per_stage, capacity, strict=True))
    # ... but stage 0 peaks above its capacity: receive buffers, bf16 weight casts, the backward's transient
    check = MemoryCheck(layers, "1f1b", 16, 1, capacity)
    peaks = MemoryModel(layers, "1f1b", 8, 16).peaks(split)
    assert peaks[0] > capacity[0] and not check.fits(split)
    # The planner (equal decoder layers, a light embedding, a head of three) picks the fastest split that fits
    costs = [0.2, *([1.0] * 32), 3.0]
    model = StepModel(costs, [2 * c for c in costs], 16, "1f1b")
    found = makespan_split(model, 8, memory=check)
    assert found is not None
    assert check.fits(found[1]) and found[1][0] < split[0]
    assert all(p <= c for p, c in zip(check.peaks(found[1]), capacity, strict=True))
