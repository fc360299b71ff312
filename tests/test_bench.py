"""dynmo-bench end to end on a tiny grid: layer costs, timelines, real A/B on two ranks, simulation, the report."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from dynmo_lightning.launch import clean_env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_tiny_grid(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dynmo_lightning.bench",
        "dynamics=[freezing]",
        "layer_costs.shape={hidden: 32, heads: 2, seq: 32, micro_batch: 1, vocab: 64, mlp_ratio: 4, n_experts: 4, "
        "attn_block: 8}",
        "layer_costs.long_seq=64",
        "layer_costs.min_run_time=0.01",
        "timeline.model={n_blocks: 6, n_embd: 16, n_head: 2, seq: 16, batch: 4, steps: 30, lr: 3.0e-3, seed: 0}",
        "real.dynamics=[freezing]",
        "real.policies=[uniform,static_time,optimal]",
        "real.also={schedule: zbv, stages_per_rank: 2, dynamics: [freezing], policies: [uniform, optimal]}",
        "real.repeats=2",
        "real.steps=30",
        "real.measure_from=26",
        "real.model={n_layer: 4, n_embd: 32, n_head: 2, block_size: 16}",
        "real.data={block_size: 16, batch_size: 8}",
        "real.balancer={every_n_steps: 5, warmup_steps: 2, min_gain: 0.0}",
        "scale.stages=[2,4]",
        "scale.sweep_stages=4",
        "scale.bandwidths=[1.0e9]",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Progress: which case, how far, the time left.
    # both arms alternate in one launch: 1F1B's three policies and ZBV's two, per repeat
    assert "[dynmo-bench] real 10/10 freezing-optimal-1" in proc.stdout
    assert "[dynmo-bench] timeline 6/6" in proc.stdout  # none + the five strengths of the freezing sweep

    costs = json.loads((tmp_path / "layer_costs.json").read_text())
    assert costs["block"]["frozen"]["bwd"] == 0.0 < costs["block"]["trainable"]["bwd"]
    assert "sparse" in json.loads((tmp_path / "layer_costs_long.json").read_text())

    real = json.loads((tmp_path / "real.json").read_text())
    rows = {r["policy"]: r for r in real["rows"]}
    assert rows["uniform"]["ratio"] == 1.0 and len(rows["optimal"]["ratios"]) == 2
    assert rows["optimal"]["ratio_low"] <= rows["optimal"]["ratio"] <= rows["optimal"]["ratio_high"]
    assert rows["optimal"]["ideal_ratio"] > 0 and real["link"]["p2p_bytes_per_s"] > 0
    # the dynamic part measured: DynMo over the split balanced once, paired by repeat
    over = rows["optimal"]["over_static_time"]
    assert over["ratio_low"] <= over["ratio"] <= over["ratio_high"] and rows["static_time"]["over_static_time"]
    zbv = json.loads((tmp_path / "real_zbv.json").read_text())
    assert zbv["config"]["schedule"] == "zbv" and {r["policy"] for r in zbv["rows"]} == {"uniform", "optimal"}
    same = {r["policy"]: r for r in zbv["same_run"]["rows"]}  # ZBV over 1F1B, the same processes, by repeat
    assert zbv["same_run"]["vs"] == "real" and set(same) == {"uniform", "optimal"}
    assert len(same["optimal"]["ratios"]) == 2

    sim = json.loads((tmp_path / "simulated.json").read_text())
    assert set(sim["dynamics"]) == {"none", "freezing"} and sim["network"]["migration_bandwidth"] > 0
    freezing = sim["dynamics"]["freezing"]
    assert set(freezing["by_stages"]) == {"2", "4"}
    assert [p["strength"] for p in freezing["strength_sweep"]] == [40.0, 60.0, 80.0, 95.0, 99.0]
    for cmp in freezing["by_stages"].values():
        assert cmp["policies"]["uniform"]["speedup"] == 1.0
        # The oracle re-splits optimally at every step for free: no policy beats it.
        assert all(p["speedup"] <= cmp["oracle"]["speedup"] * (1 + 1e-9) for p in cmp["policies"].values())
    # the same ranks under each zero-bubble schedule (two stages each, in a V or looped): uniform, DynMo, oracle
    assert tuple(freezing["zero_bubble"]) == ("zbv", "interleaved_zb", "dualpipev")
    for schedule, by_ranks in freezing["zero_bubble"].items():
        for p, zb in by_ranks.items():
            assert (zb["schedule"], zb["n_ranks"], zb["n_stages"]) == (schedule, int(p), 2 * int(p))
            assert set(zb["policies"]) == {"uniform", "optimal"}
            assert zb["policies"]["optimal"]["speedup"] <= zb["oracle"]["speedup"] * (1 + 1e-9)
    with gzip.open(tmp_path / "traces" / "freezing.jsonl.gz", "rt") as f:
        trace = [json.loads(line) for line in f]
    assert len(trace) == 30 and len(trace[0]["fwd"]) == 8  # embedding, six blocks, head
    # the weight-gradient part of every backward, measured (timings: bounded, not compared), for the zero-bubble
    # replays
    assert all(0.0 <= w <= b for s in trace for w, b in zip(s["bwd_weight"], s["bwd"], strict=True))

    md = (tmp_path / "benchmarks.md").read_text()
    for section in ("## DynMo at scale", "### Zero-bubble pipelines", "## Real A/B on this machine", "## Layer costs"):
        assert section in md
    assert "(plots/speedup.png)" in md and (tmp_path / "plots" / "real.png").is_file()
