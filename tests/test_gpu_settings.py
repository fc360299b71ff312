"""GPU settings: bf16-mixed by default on GPUs, 16-mixed and gloo-with-CUDA refused before any worker starts.

The refusals run in the launching process (``PipelineLauncher``), so they are checked here on CPU with the devices a
GPU job would have: no GPU is needed to see that nothing was started.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from lightning.pytorch.plugins.precision import MixedPrecision

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.cli import CONF_DIR, build_trainer, trainer_precision
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.strategy.checks import check_backend

CUDA = [torch.device("cuda", 0), torch.device("cuda", 1)]
PACKAGE = Path(__file__).resolve().parent.parent / "dynmo_lightning"


def test_only_the_hydra_entry_points_import_hydra():
    # GPU machines may lack Hydra: all but dynmo-train/dynmo-export (cli) and dynmo-bench (bench/main) import without.
    users = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.partition(".")[0] in ("hydra", "omegaconf") for n in names):
                users.add(str(path.relative_to(PACKAGE)))
    assert users == {"cli.py", "bench/main.py"}


@pytest.mark.parametrize(
    ("precision", "accelerator", "cuda", "expected"),
    [
        (None, "gpu", False, "bf16-mixed"),
        (None, "cuda", False, "bf16-mixed"),
        (None, "cpu", True, "32-true"),
        (None, "auto", True, "bf16-mixed"),
        (None, "auto", False, "32-true"),
        ("32-true", "gpu", True, "32-true"),  # asked for: fp32 on the GPU
        ("bf16-mixed", "cpu", False, "bf16-mixed"),
    ],
)
def test_unset_precision_is_bf16_mixed_on_gpus_and_fp32_elsewhere(monkeypatch, precision, accelerator, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert trainer_precision(precision, accelerator) == expected


def test_dynmo_train_builds_an_fp32_trainer_on_cpu_by_default(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"run_dir={tmp_path}"])
    assert cfg.trainer.precision is None and cfg.trainer.accelerator == "cpu"
    assert build_trainer(cfg).precision == "32-true"


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip


def _fit(trainer: L.Trainer) -> None:
    trainer.fit(
        GPT(n_layer=2, n_embd=16, n_head=2, block_size=16),
        datamodule=StdlibCharDataModule(block_size=16, batch_size=4, max_bytes=50_000),
    )


def test_16_mixed_is_refused_before_launch_naming_bf16_mixed():
    # The plugin Lightning makes for precision="16-mixed" on a GPU (on CPU it would switch to bf16 by itself).
    trainer = _trainer(strategy=DynMoStrategy(n_microbatches=2), plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(ValueError, match="bf16-mixed is the supported mixed precision"):
        _fit(trainer)
    assert not dist.is_initialized()


def test_gloo_for_cuda_devices_is_refused_before_launch():
    trainer = _trainer(strategy=DynMoStrategy(n_microbatches=2, process_group_backend="gloo"))
    trainer.strategy.parallel_devices = CUDA  # what Trainer(accelerator="gpu", devices=2) gives the strategy
    with pytest.raises(ValueError, match=r"strategy.process_group_backend='gloo' cannot run a pipeline on CUDA"):
        _fit(trainer)
    assert not dist.is_initialized()  # no worker and no process group was started


@pytest.mark.parametrize(
    ("backend", "devices", "refused"),
    [
        ("gloo", CUDA, True),
        ("cpu:nccl,cuda:gloo", CUDA, True),
        ("cpu:gloo,cuda:nccl", CUDA, False),
        ("nccl", CUDA, False),
        (None, CUDA, False),  # chosen per device: NCCL
        ("gloo", [torch.device("cpu")] * 2, False),
    ],
)
def test_which_backends_can_carry_which_devices(backend, devices, refused):
    if refused:
        with pytest.raises(ValueError, match="Leave process_group_backend unset"):
            check_backend(backend, devices)
    else:
        check_backend(backend, devices)
