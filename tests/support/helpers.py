"""Helpers shared by tests: run `dynmo-train` (the Hydra CLI) in fresh processes, as users do; compare runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dynmo_lightning.launch import run_ranks
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

#: A gpt_tiny small enough that a 20-step run of 4 processes takes seconds on 2 cores.
TINY = [
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "model.warmup_steps=0",
    # Untied, so that pipeline runs are bit-identical to one process; tests/pipeline/test_ties.py covers the tied
    # default, which is equal up to the reassociation of the tied gradient's sum.
    "model.tie_embeddings=false",
    "data.block_size=32",
    "data.batch_size=16",
    "data.max_bytes=300000",
    "data.max_val_batches=2",
    "trainer.limit_val_batches=2",
    "trainer.val_check_interval=10",
    "trainer.enable_progress_bar=false",
    "trainer.gradient_clip_val=0.5",
    "logger.csv=false",
    "strategy.timeout=60",
]

#: Two replicas with half the batch each: the same global batch of 16 as one replica of TINY.
DP2 = ["strategy.data_parallel_size=2", "data.batch_size=8"]

# Layers 0-3 of 6 freeze at step 3: only block 3 and the head train (their forward+backward) afterwards.
FREEZE = ["dynamics=freezing", "dynamics.mode=schedule", "dynamics.schedule={0:3,1:3,2:3,3:3}", "dynamics.start_step=0"]
# ... so that two stages do the work of four within the tolerance: consolidate onto two processes.
REPACK = [
    "balancer=optimal",
    "balancer.every_n_steps=5",
    "balancer.warmup_steps=2",
    "balancer.repack=true",
    "balancer.repack_tolerance=0.5",
    "balancer.min_stages=2",
]

# The balancer moves layers to a random split every 5 steps (the math must not change).
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=5", "balancer.warmup_steps=0"]
ZBV = ["strategy.schedule=zbv", "strategy.stages_per_rank=2"]
#: Whether the V schedules run on gloo here: torch 2.11's runtime sends their middle stages' shapes from a process to
#: itself, which gloo cannot do (refused before launch there: ``checks.check_v_schedule``).
V_ON_GLOO = torch.__version__ >= (2, 13)
#: Marks a case of a V schedule on gloo (skipped, with the reason, on an older torch).
needs_v = pytest.mark.skipif(not V_ON_GLOO, reason="V schedules on gloo need torch >= 2.13 (checks.check_v_schedule)")
MOVING = [*FREEZE, *RANDOM, "trainer.max_steps=20"]
# A checkpoint at step 10 (the end of an epoch of 10 batches), resumed to step 12.
EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]
#: Small Hugging Face models, as tests/models/test_hf.py trains them with dynmo-train: a Llama (4 heads, 2 key/value
#: heads) and a GPT-2 (tied embeddings); HF_BASE is what their runs share.
LLAMA = ["model=hf_llama", "model.model_or_config.hidden_size=32", "model.model_or_config.intermediate_size=64"]
GPT2 = ["model=hf_gpt2", "model.model_or_config.n_embd=32"]
HF_BASE = [
    "data.block_size=32",
    "data.batch_size=8",
    "data.max_bytes=100000",
    "trainer.max_steps=10",
    "trainer.limit_val_batches=1",
    "trainer.val_check_interval=5",
    "trainer.enable_progress_bar=false",
    "trainer.gradient_clip_val=0.5",
    "logger.csv=false",
    "strategy.timeout=60",
]


def slow(test: Any) -> Any:
    """Mark a test of launched multi-process runs: the slow lane, with a timeout long enough for a module's launches."""
    return pytest.mark.timeout(1500)(pytest.mark.slow(test))


class CliRun:
    """A finished `dynmo-train` run: its directory, summary and end-of-training checkpoint."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def checkpoint(self) -> dict[str, Any]:
        return load_whole(self.run_dir / "checkpoints" / "final.ckpt")  # sharded (a directory) or one file


def launch_script(world_size: int, script: Path, *args: str, log_dir: Path, timeout: float = 600) -> None:
    """Run ``script`` in ``world_size`` processes as ranks of one job; fail with every log unless all exit 0."""
    tag = f"{script.stem}-{world_size}-{len(list(log_dir.iterdir())) if log_dir.exists() else 0}"
    codes = run_ranks(world_size, [sys.executable, str(script), *args], log_dir=log_dir, tag=tag, timeout=timeout)
    if any(c != 0 for c in codes):
        logs = "\n".join(
            f"--- rank {r} (exit {c}) ---\n{(log_dir / f'{tag}.rank{r}.log').read_text()[-4000:]}"
            for r, c in enumerate(codes)
        )
        raise AssertionError(f"{script.name} on {world_size} processes failed:\n{logs}")


def launch(
    world_size: int,
    cases: dict[Path, list[str]],
    timeout: float = 600,
    *,
    inject_costs: bool = False,
    load_rises_at: int | None = None,
    slow_process: tuple[int, float, int] | None = None,
    forbid_gathers: bool = False,
    base: list[str] = TINY,
) -> dict[Path, CliRun]:
    """Run several dynmo-train configurations in one launch of ``world_size`` processes (``tests/support/_worker.py``).

    Every case gets the tiny config plus its overrides and ``trainer.devices=world_size``; returns one
    :class:`CliRun` per run directory. ``inject_costs``: the balancer plans from structural layer costs instead of
    measured times (``tests/support/injected_costs.py``), for tests whose verdict depends on its decisions; from step
    ``load_rises_at`` on, frozen layers cost as if they trained again; with ``slow_process = (pipeline rank, factor,
    from step)`` that process measures ``factor`` times slower from then on, its calibration kernel too (injected,
    not timed). ``forbid_gathers``: every gather collective
    raises while the balancer plans (``tests/support/_worker.py``). ``base``: the overrides every case starts from
    (the tiny GPT's; another model's for Hugging Face cases).
    """
    spec_dir = next(iter(cases)).parent
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "cases": [
            {"run_dir": str(d), "overrides": [*base, *o, f"trainer.devices={world_size}"]} for d, o in cases.items()
        ],
        "inject_costs": inject_costs,
        "load_rises_at": load_rises_at,
        "slow_process": slow_process,
        "forbid_gathers": forbid_gathers,
    }
    spec_path = spec_dir / f"spec-{world_size}-{len(list(spec_dir.iterdir()))}.json"
    spec_path.write_text(json.dumps(spec))
    launch_script(world_size, Path(__file__).with_name("_worker.py"), str(spec_path), log_dir=spec_dir, timeout=timeout)
    return {d: CliRun(d) for d in cases}


def assert_close_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Same keys and every tensor within ``rtol`` relative (to its norm) of the other."""
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))[:10]
    for k in a:
        x, y = a[k].double(), b[k].double()
        assert x.shape == y.shape, k
        err = (x - y).norm() / max(float(y.norm()), 1e-12)
        assert err <= rtol, f"{k}: relative difference {float(err):.2e} > {rtol}"


def assert_close_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Same keys, and the whole parameter vector within ``rtol`` relative of the other.

    For runs that are equal up to float reassociation (summing a tied parameter's gradient across stages adds the
    same terms in another order): tiny tensors then differ relatively more than the model does.
    """
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a) ** 0.5
    norm = sum(float(b[k].double().square().sum()) for k in b) ** 0.5
    assert diff <= rtol * norm, f"relative difference {diff / norm:.2e} > {rtol}"


def assert_close_losses(a: list[float], b: list[float], rtol: float = 1e-5) -> None:
    assert len(a) == len(b) and a, (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert abs(x - y) <= rtol * abs(y), f"step {i}: {x} vs {y}"
