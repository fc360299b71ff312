"""Layer-state timelines of real (tiny) runs, and their realistic cost traces."""

from __future__ import annotations

import pytest
from support.bench_data import synthetic_table

from dynmo_lightning.bench.layer_costs import CostTable
from dynmo_lightning.bench.timeline import PRESETS, TimelineConfig, realistic_trace, record

TINY = TimelineConfig(n_blocks=4, n_embd=32, n_head=2, seq=16, batch=4, steps=30, seed=0)


@pytest.fixture(scope="module")
def timelines():
    strengths = {"freezing": 80.0, "pruning": 0.7, "early_exit": 0.25, "mod": 0.25, "moe": 1.0, "sparse_attention": 0.5}
    return {d: record(d, s, TINY) for d, s in strengths.items()} | {"none": record("none", None, TINY)}


@pytest.mark.timeout(300)
def test_every_dynamic_leaves_its_mark_on_the_layer_states(timelines):
    for dynamic, tl in timelines.items():
        states = tl["states"]
        assert len(states) == TINY.steps and len(tl["train_loss"]) == TINY.steps and tl["val_loss"] > 0, dynamic
        assert all(len(s["frozen"]) == TINY.n_blocks + 2 for s in states)
    last = {d: tl["states"][-1] for d, tl in timelines.items()}
    assert sum(last["freezing"]["frozen"]) >= 1 and not any(last["none"]["frozen"])
    frozen = last["freezing"]["frozen"]
    assert frozen == sorted(frozen, reverse=True)  # a prefix
    assert max(k for k in last["pruning"]["mlp_kept"] if k is not None) < 1.0
    assert min(a for a in last["early_exit"]["active"]) < 1.0 and last["early_exit"]["active"][0] == 1.0
    assert 0.25 in last["mod"]["capacity"] and None in last["mod"]["capacity"]  # every other block routes
    shares = [e for e in last["moe"]["experts"] if e is not None]
    assert shares and all(0.0 <= sum(e) <= 1.0 + 1e-6 for e in shares)
    assert min(d for d in last["sparse_attention"]["density"] if d is not None) < 1.0


def test_realistic_trace_prices_each_state():
    table = CostTable(synthetic_table())
    n = 5
    base = {
        "frozen": [False] * n,
        "mlp_kept": [None, 1.0, 1.0, 1.0, None],
        "heads_kept": [None, 1.0, 1.0, 1.0, None],
        "capacity": [None] * n,
        "density": [None] * n,
        "active": [1.0] * n,
        "experts": [None] * n,
    }
    step1 = {**base, "frozen": [True, True, False, False, False], "mlp_kept": [None, 1.0, 0.5, 1.0, None]}
    step1 = {**step1, "heads_kept": [None, 1.0, 0.5, 1.0, None], "active": [1.0, 1.0, 1.0, 0.5, 1.0]}
    trace = realistic_trace({"states": [base, step1]}, table)
    first, second = trace
    assert first["fwd"] == [0.01, 1.0, 1.0, 1.0, 2.0] and first["bwd"] == [0.02, 2.0, 2.0, 2.0, 4.0]
    assert second["bwd"][:2] == [0.0, 0.0] and second["fwd"][1] == 0.9  # the frozen prefix: forward only
    assert second["fwd"][2] == pytest.approx(0.4 * 0.5 + 0.6 * 0.5)  # pruned halves
    assert second["fwd"][3] == pytest.approx(0.6) and second["bwd"][3] == pytest.approx(1.2)  # half the tokens
    assert second["changed_layers"] == [0, 1, 2] and first["changed_layers"] == []
    assert second["optim_bytes"][0] == 0 < second["optim_bytes"][2] < first["optim_bytes"][2]  # no Adam state
    assert all(k in first for k in ("param_bytes", "activation_bytes", "step"))


def test_presets_name_their_papers_and_sweep_through_the_preset():
    for preset in PRESETS.values():
        assert preset.preset in preset.sweep and preset.name and preset.strength
