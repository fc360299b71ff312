"""Mistakes the launching process can see are refused there: one message, non-zero exit, before any worker starts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dynmo_lightning.launch import clean_env


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # gpt_tiny has 6 pipeline layers (embedding, 4 blocks, head)
        (["trainer.devices=8"], "8 pipeline stages, but the model has only 6 layers"),
        (["data.batch_size=10"], "A batch of 10 samples does not split into strategy.n_microbatches=4"),
        (["trainer.devices=3", "strategy.data_parallel_size=2"], "data_parallel_size=2 does not divide the job's 3"),
        (["trainer.devices=3", "strategy.n_microbatches=2"], "strategy.n_microbatches=2 < 3 pipeline ranks"),
        (["strategy.partition=[1,1]"], "partition [1, 1] sums to 2 but the model has 6 layers"),
        (["balancer=optimal", "balancer.repack=true", "balancer.min_stages=9"], "min_stages=9 > the pipeline"),
        (["balancer=optimal", "balancer.memory_capacity=1"], "memory_capacity=1 bytes cannot hold the model"),
        (["balancer=optimal", "balancer.memory_capacity=[1e9,1e9,1e9]"], "has 3 entries for the job's 2 pipeline"),
        (["strategy.n_microbatches=0"], "strategy.n_microbatches=0 must be a positive integer"),
    ],
)
def test_refused_once_before_any_worker_starts(tmp_path, overrides, message):
    exe = shutil.which("dynmo-train") or str(Path(os.sys.executable).with_name("dynmo-train"))
    cmd = [exe, *overrides, f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=2"]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=200, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count(message) == 1, out[-3000:]
    # One line, no traceback: the line names the setting.
    assert "Traceback" not in out and proc.stderr.strip().splitlines()[-1].startswith("dynmo-train: error: "), out
    # No process group was set up: the workers were never started.
    assert "Initializing distributed" not in out and "MEMBER:" not in out, out[-3000:]
