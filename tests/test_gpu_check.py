"""The prepared GPU check runs end to end on CPU (the same code path it takes on a GPU) and writes its summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_lightning.launch import clean_env

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "gpu_check.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--steps", "5", "--dynamics",
           "none,early_exit", "--pipeline", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=560, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["device"] == "cpu" and set(summary["dynamics"]) == {"none", "early_exit"}
    for entry in summary["dynamics"].values():
        assert 0 < entry["of_which_optimizer_step"] <= entry["syncs_per_step"] and math_finite(entry["final_loss"])
        # the profiler comparison is reported (its value is a measurement: the summary's business, not a verdict)
        assert set(entry["profiler"]) == {"layers_s", "step_wall_s", "torch_profiler_s", "layers_share_of_step"}
    assert summary["pipeline_p2"] == {"ok": True, "max_rel_loss_diff_vs_p1": pytest.approx(0.0, abs=1e-5)}
    assert summary["layer_costs"]["block"]["trainable"]["fwd"] > 0


def math_finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
