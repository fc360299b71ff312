"""The example scripts import (their names still exist in the package), and each runs in its smallest configuration:
a renamed helper or a broken code path fails here, not in a user's hands."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_lightning.launch import clean_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_example_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # runs the imports and definitions, not the script (guarded by __main__)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
#: Every example in its smallest configuration (gpu_check.py: tests/test_gpu_check.py), with how it is started.
SMALLEST: dict[str, tuple[list[str], list[str]]] = {
    "train_gpt.py": ([sys.executable], ["--devices", "2", "--max-steps", "3"]),
    "train_hf_llama.py": ([sys.executable], ["--devices", "2", "--max-steps", "3", "--layers", "2"]),
    "bench_balance.py": ([*TORCHRUN, "--nproc_per_node=2"], ["--steps", "6", "--measure-from", "3", "--repeats", "1",
                         "--hidden", "32", "--block", "16", "--batch", "8", "--microbatches", "2"]),
    "bench_checkpoint.py": ([*TORCHRUN, "--nproc_per_node=2"], ["--layers", "4", "--hidden", "32", "--repeats", "1"]),
    "bench_repack.py": ([*TORCHRUN, "--nproc_per_node=2"], ["--steps", "12", "--layers", "4", "--hidden", "32",
                        "--block", "16", "--batch", "8"]),
    "bench_diffusion.py": ([sys.executable], ["--layers", "8", "--repeats", "1", "--stages", "8", "--real", "2"]),
    "bench_hf_memory.py": ([sys.executable], ["--processes", "2", "--hidden", "64", "--layers", "2",
                           "--intermediate", "128", "--vocab", "256"]),
    "validate_sim.py": ([*TORCHRUN, "--nproc_per_node=2"], ["--steps", "6", "--skip", "2", "--layers", "4",
                        "--hidden", "32", "--block", "16", "--batch", "8", "--microbatches", "2"]),
    "soak.py": ([sys.executable], ["--steps", "20", "--epoch", "5", "--dir", "runs"]),
    "bench_activation_checkpointing.py": ([sys.executable], ["--layers", "4", "--embd", "32", "--heads", "2", "--seq",
                                          "32", "--batch", "4", "--microbatches", "2"]),
    "bench_data_parallel.py": ([*TORCHRUN, "--nproc_per_node=4"], ["--steps", "3", "--measure-from", "1", "--repeats",
                               "1", "--layers", "4", "--hidden", "32", "--block", "16", "--batch", "4"]),
    "bench_pruning_in_parts.py": ([*TORCHRUN, "--nproc_per_node=4"], ["--steps", "4", "--measure-from", "2",
                                  "--repeats", "1", "--layers", "2", "--hidden", "32", "--block", "16",
                                  "--batch", "4"]),
    "bench_compile.py": ([*TORCHRUN, "--nproc_per_node=2"], ["--steps", "3", "--measure-from", "1", "--repeats", "1",
                         "--layers", "4", "--hidden", "32", "--block", "16", "--batch", "4"]),
    "count_syncs.py": ([sys.executable], ["--layouts", "pp2", "--dynamics", "none"]),
}  # fmt: skip


def test_every_example_has_a_smallest_configuration():
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts - {"gpu_check.py"} == set(SMALLEST)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_example_runs_in_its_smallest_configuration(name, tmp_path):
    launcher, args = SMALLEST[name]
    out = tmp_path / "out.json"
    cmd = [*launcher, str(EXAMPLES / name), *args, *(["--out", str(out)] if _takes_out(name) else [])]
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(EXAMPLES)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if _takes_out(name):
        assert json.loads(out.read_text())  # wrote its results


def _takes_out(name: str) -> bool:
    return "--out" in (EXAMPLES / name).read_text()
