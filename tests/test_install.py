"""An installed package works: the wheel carries its configs, and `dynmo-train` runs from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dynmo_lightning.launch import clean_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installed_in_a_fresh_environment_trains_from_any_directory(tmp_path):
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    subprocess.run([*build, str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = dist.glob("dynmo_lightning-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dynmo_lightning/conf/config.yaml" in names and "dynmo_lightning/conf/bench/config.yaml" in names
    metadata = next(n for n in names if n.endswith("METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()

    # A fresh environment that sees the project's dependencies (not the project itself), with the wheel installed.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True, capture_output=True
    ).stdout.strip()
    Path(site, "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the dependencies' directory holds this project's own (editable) metadata too.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    subprocess.run([*install, "--ignore-installed", "-q", str(wheel)], check=True, timeout=300, env=env)
    where = subprocess.run(
        [python, "-c", "import dynmo_lightning; print(dynmo_lightning.__file__)"],
        env=env, cwd=tmp_path, text=True, capture_output=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the installed copy, not the checkout

    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    overrides = ["trainer.max_steps=2", "trainer.devices=1", "data.max_bytes=100000", "model.n_layer=2"]
    cmd = [str(venv / "bin" / "dynmo-train"), *overrides, "hydra.run.dir=run", "trainer.limit_val_batches=1"]
    proc = subprocess.run(cmd, env=env, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((elsewhere / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and os.path.exists(elsewhere / "run" / "checkpoints" / "final.ckpt")
    # dynmo-bench's entry point (its Hydra module) and the benchmark config it ships
    bench = subprocess.run([str(venv / "bin" / "dynmo-bench"), "--help"], env=env, cwd=elsewhere, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert bench.returncode == 0 and "layer_costs:" in bench.stdout, (bench.stdout + bench.stderr)[-3000:]
