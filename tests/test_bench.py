"""dynmo-bench end to end on a tiny grid: real A/B runs (consolidation included), traces, simulation, report."""

from __future__ import annotations

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
        "policies=[uniform,optimal,optimal+repack]",
        "real.repeats=1",
        "real.steps=12",
        "real.measure_from=6",
        "real.every_n_steps=5",
        "real.model={n_layer: 2, n_embd: 32, n_head: 4, block_size: 32}",
        "real.data={block_size: 32, batch_size: 8}",
        "trace.steps=16",
        "trace.model={n_layer: 10, n_embd: 32, n_head: 2, block_size: 32}",
        "trace.data={block_size: 32, batch_size: 8}",
        "sim.stages=[4,8]",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[dynmo-bench] 3/3 freezing-optimal+repack-0" in proc.stdout  # progress: case, how far, time left
    results = json.loads((tmp_path / "results.json").read_text())
    real = {r["policy"]: r for r in results["real"]}
    assert real["uniform"]["ratio_to_uniform"] == 1.0 and real["optimal"]["ideal_ratio"] > 0
    sim = [r for r in results["simulated"] if r["n_stages"] == 8]
    assert {r["policy"] for r in sim} == {"uniform", "optimal", "optimal+repack"}
    assert all(len(r["stage_loads"]) == len(r["steps"]) == 16 for r in sim)
    assert "Summary" in (tmp_path / "benchmarks.md").read_text() and list((tmp_path / "plots").glob("*.png"))
