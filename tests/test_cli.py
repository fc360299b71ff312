"""`dynmo-train`: the console script, Hydra overrides and multirun sweeps with multi-process training."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from support.helpers import TINY

from dynmo_lightning.cli import CONF_DIR
from dynmo_lightning.launch import clean_env

SUMMARY_KEYS = {
    "steps",
    "losses",
    "final_loss",
    "val_loss",
    "tokens_per_s",
    "world_size_start",
    "world_size_end",
    "partitions",
    "param_norm",
}


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=gpt_small"],
        ["trainer.devices=4", "trainer.max_steps=7", "seed=3"],
        ["strategy.schedule=gpipe", "strategy.n_microbatches=8", "strategy.partition=[2,4]"],
        ["strategy.schedule=interleaved_1f1b", "strategy.stages_per_rank=2"],
        ["strategy.schedule=zbv", "strategy.stages_per_rank=2"],
    ],
)
def test_overrides_compose(overrides):
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "run_dir=/tmp/x"])
    strategy = instantiate(cfg.strategy)
    assert strategy.schedule == cfg.strategy.schedule
    model = instantiate(cfg.model, _convert_="all")
    assert model.hparams.block_size == cfg.data.block_size
    assert model.pipeline_init_seed == cfg.seed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multirun_sweep_with_two_processes_per_job(tmp_path):
    exe = shutil.which("dynmo-train") or str(Path(os.sys.executable).with_name("dynmo-train"))
    env = clean_env()
    cmd = [
        exe,
        "-m",
        *TINY,
        "logger.csv=true",
        "trainer.devices=2",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.log_every_n_steps=2",
        "strategy.schedule=gpipe,1f1b",
        f"hydra.sweep.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summaries = []
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert SUMMARY_KEYS <= summary.keys()
        assert summary["steps"] == 6 and len(summary["losses"]) == 6
        assert summary["world_size_start"] == summary["world_size_end"] == 2
        assert summary["partitions"] == [{"step": 0, "layers_per_stage": [3, 3]}]
        assert summary["tokens_per_s"] > 0 and summary["val_loss"] is not None
        with open(tmp_path / job / "csv" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert any(r.get("train_loss") for r in rows) and any(r.get("val_loss") for r in rows)
        summaries.append(summary)
    # the two jobs ran different schedules, and schedules never change the math
    assert summaries[0]["losses"] == pytest.approx(summaries[1]["losses"], rel=1e-5)
    # the sweep did not leak stray run directories (each worker re-ran its own job, not the sweep)
    assert not (tmp_path / "outputs").exists() and sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "0",
        "1",
    ]
