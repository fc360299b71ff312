"""The memory model against torch's MemTracker on fake tensors, and planning a 7B-shaped model within a capacity.

A smaller version of ``docs/bench/memory_model.json`` is rebuilt here (a 6-block GPT, P = 4 and the V at P = 2);
the committed table (1B GPT and 7B Llama, P = 4 and 8) is checked as committed. Nothing is allocated at size: the
stages run on fake tensors (``dynmo_lightning.bench.memory``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmo_lightning.balance.steptime.memory_model import MemoryCheck, MemoryModel, additive
from dynmo_lightning.balance.steptime.planner import StepModel, makespan_split
from dynmo_lightning.bench.memory import MODELS, SCHEDULE_CASES, compare, gpt_stack, layer_bytes

TABLE = Path(__file__).resolve().parents[2] / "docs" / "bench" / "memory_model.json"
GiB = 2**30


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "spr", "recompute", "ranks"), [
    ("1f1b", 1, False, 4), ("1f1b", 1, True, 4), ("gpipe", 1, False, 4), ("gpipe", 1, True, 4), ("zbv", 2, False, 2),
])  # fmt: skip
def test_every_stages_predicted_peak_is_within_ten_percent_of_the_tracked_one(schedule, spr, recompute, ranks):
    stack = gpt_stack(n_layer=6, n_embd=256, n_head=4, seq=256, vocab=1024, microbatch=2, autocast=True)
    rows = compare(stack, ranks, schedule, spr, recompute, n_microbatches=8)
    assert len(rows) == ranks
    for row in rows:
        assert abs(row["relative_error"]) <= 0.10, row


def test_the_committed_table_is_complete_and_within_ten_percent():
    table = json.loads(TABLE.read_text())
    rows = table["rows"]
    cases = {(r["model"], r["ranks"], r["schedule"], r["activation_checkpointing"]) for r in rows}
    wanted = {(m, p, s, ac) for m in MODELS for p in (4, 8) for s, _, ac in SCHEDULE_CASES}
    assert cases == wanted
    assert {r["case"] for r in rows if r["model"] == "llama_7b" and r["ranks"] == 8}  # the 7B shape at P = 8
    assert all(abs(r["predicted_bytes"] / r["tracked_bytes"] - 1) <= 0.10 for r in rows)
    assert table["max_abs_relative_error"] <= 0.10


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
