"""Layer costs at LLM size: the measurement's shape, and the table's interpolation (synthetic numbers, no timing)."""

from __future__ import annotations

import json

import pytest
import torch
from support.bench_data import synthetic_table

from dynmo_lightning.bench.layer_costs import CostTable, LayerShape, graft_weight_parts, measure


def test_table_interpolates_every_axis():
    table = CostTable(json.loads(json.dumps(synthetic_table())))  # keys of the axes are strings after JSON
    assert table.block() == (1.0, 2.0, 0.0)  # no weight split in this table: zero-bubble W tasks cost nothing
    assert table.block(frozen=True) == (0.9, 0.0, 0.0)
    # a pruned block costs its halves; pruned and frozen: its forward, scaled as the dense block's, no backward
    assert table.block(mlp_kept=0.5, heads_kept=0.25) == pytest.approx(
        (0.4 * 0.25 + 0.6 * 0.5, 0.8 * 0.25 + 1.2 * 0.5, 0.0)
    )
    assert table.block(frozen=True, mlp_kept=0.5, heads_kept=0.5) == pytest.approx((0.5 * 0.9, 0.0, 0.0))
    assert table.exit(0.75) == pytest.approx((0.8, 1.6, 0.0))
    assert table.mod(0.375) == pytest.approx((0.375, 0.75, 0.0))
    assert table.sparse(1.0) == pytest.approx((1.0, 2.0, 0.0))
    assert table.moe([12, 16, 0]) == pytest.approx((0.5 + 0.15 + 0.2, 1.0 + 0.3 + 0.4, 0.0))
    assert table.end("head") == (2.0, 4.0, 0.0)


def test_weight_parts_are_interpolated_summed_and_grafted():
    raw = synthetic_table()
    # a fresh measurement at the same shape: every backward half weight gradient, the embedding's all of it
    fresh = json.loads(json.dumps(raw))
    for entry in _costs(fresh):
        entry["bwd"] *= 1.1  # another run measures other times: only the share is grafted
        entry["wgt"] = entry["bwd"] / 2
    fresh["embedding"]["wgt"] = fresh["embedding"]["bwd"]
    table = CostTable(graft_weight_parts(json.loads(json.dumps(raw)), fresh))
    assert table.block() == pytest.approx((1.0, 2.0, 1.0))  # the committed times stay, the share is the fresh one
    assert table.block(frozen=True) == (0.9, 0.0, 0.0)
    assert table.block(mlp_kept=0.5, heads_kept=0.25).wgt == pytest.approx((0.8 * 0.25 + 1.2 * 0.5) / 2)
    assert table.exit(0.75).wgt == pytest.approx(0.8) and table.mod(0.375).wgt == pytest.approx(0.375)
    assert table.moe([12, 16, 0]).wgt == pytest.approx((1.0 + 0.3 + 0.4) / 2)
    assert table.end("embedding") == pytest.approx((0.01, 0.02, 0.02)) and table.end("head").wgt == 2.0
    with pytest.raises(ValueError, match="measured at"):
        graft_weight_parts(raw, fresh | {"shape": {**raw["shape"], "hidden": 128}})


def _costs(table: dict) -> list[dict]:
    """Every cost entry of a table (a dict with a backward time), wherever it sits."""
    found, stack = [], [table]
    while stack:
        node = stack.pop()
        if "bwd" in node:
            found.append(node)
        else:
            stack += [v for v in node.values() if isinstance(v, dict)]
    return found


def test_measure_times_every_state_on_a_small_layer():
    shape = LayerShape(hidden=32, heads=2, seq=32, vocab=64, n_experts=4, attn_block=8)
    parts = ["dense and frozen block", "early exit", "embedding and head"]
    # On the CPU whatever the machine has: `measure` picks the accelerator by default (see the next test).
    table = measure(shape, parts=parts, min_run_time=0.001, device="cpu", log=lambda s: None)
    assert table["shape"]["hidden"] == 32 and table["threads"] >= 1 and table["machine"]["device"] == "cpu"
    # A frozen block runs forward only (no backward timed at all); timings themselves are not judged here.
    assert table["block"]["frozen"]["bwd"] == 0.0 and table["block"]["trainable"]["bwd"] >= 0.0
    assert table["block"]["trainable"]["activation_bytes"] > 0 == table["block"]["frozen"]["activation_bytes"]
    assert len(table["exit"]) == 6 and all(c["fwd"] > 0 for c in table["exit"].values())
    assert table["head"]["fwd"] > 0 and "attention" not in table
    # the weight-gradient part of every backward is measured and lies within it; an embedding has no input gradient
    for cost in (table["block"]["trainable"], table["head"], *table["exit"].values()):
        assert 0.0 <= cost["wgt"] <= cost["bwd"]
    assert table["embedding"]["wgt"] == table["embedding"]["bwd"] and table["block"]["frozen"]["wgt"] == 0.0


def test_the_device_is_the_accelerator_by_default_and_the_cpu_when_asked(monkeypatch):
    # A machine with a visible GPU, on this CPU-only build: torch's accelerator queries answer as they would there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)  # torch.utils.benchmark's wait
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert measure(parts=[], log=lambda s: None)["machine"]["device"] == "NVIDIA H200"  # "auto": the GPU
    shape = LayerShape(hidden=32, heads=2, seq=32, vocab=64, n_experts=4, attn_block=8)
    table = measure(shape, parts=["embedding and head"], min_run_time=0.001, device="cpu", log=lambda s: None)
    assert table["machine"]["device"] == "cpu" and table["head"]["fwd"] > 0
