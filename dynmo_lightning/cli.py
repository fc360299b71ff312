"""Hydra entry points: ``dynmo-train``; and ``dynmo-export`` (a checkpoint as one plain ``state_dict`` file).

``dynmo-train`` composes ``conf/config.yaml`` (groups ``model``, ``data``, ``trainer``, ``strategy``, ``balancer``,
``dynamics``), trains, and writes ``summary.json``, ``csv/metrics.csv`` and ``checkpoints/final.ckpt`` (plus
``last.ckpt`` on schedule) into the run directory (``hydra.run.dir``; in a multirun, each job's own directory).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf, read_write

import dynmo_lightning  # noqa: F401  (registers strategy="dynmo")
from dynmo_lightning.callbacks import CostTrace, RunSummary
from dynmo_lightning.launch import fresh_world, torchrun_num_nodes
from dynmo_lightning.pipeline.checkpoint import sharded
from dynmo_lightning.pipeline.checkpoint.safe_load import CheckpointRefused

#: Accelerators that mean a GPU (``trainer.accelerator``).
_GPU = ("gpu", "cuda")

#: The Hydra config groups, shipped inside the package (``conf/`` at the top of the repository links here).
CONF_DIR = Path(__file__).resolve().parent / "conf"


def _pin_multirun_job() -> None:
    """Make Lightning's launcher re-run *this* multirun job, not the whole sweep, in the worker processes.

    Lightning starts ranks 1..N-1 by re-running ``sys.argv`` with ``hydra.run.dir`` set to the run directory. In a
    multirun, ``sys.argv`` holds the sweep and ``-m``, so each worker would start a sweep of its own. Pointing both
    at this job (its task overrides, its output directory) starts exactly the job's ranks.
    """
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    sys.argv = [sys.argv[0], *hc.overrides.task]
    with read_write(hc.run):
        hc.run.dir = hc.runtime.output_dir


def build_callbacks(cfg: DictConfig) -> list[Any]:
    """The callbacks a config asks for: the dynamic technique, the balancer (which reacts to it), the cost trace."""
    groups = ("dynamics", "balancer")
    callbacks = [instantiate(cfg[group], _convert_="all") for group in groups if cfg[group].get("_target_")]
    if cfg.profile.trace:
        callbacks.append(CostTrace(f"{cfg.run_dir}/costs.jsonl", every_n_steps=cfg.profile.every_n_steps))
    return callbacks


def trainer_precision(precision: str | int | None, accelerator: Any) -> str | int:
    """``trainer.precision``, where unset (``null``) means ``bf16-mixed`` on a GPU and ``32-true`` elsewhere.

    A GPU is ``trainer.accelerator=gpu`` (or ``cuda``), or ``auto`` on a machine with CUDA. bf16 autocast is the
    mixed precision DynMoStrategy supports (``16-mixed`` needs a gradient scaler inside the pipeline schedule);
    fp32 on a GPU (``trainer.precision=32-true``) runs without TF32 unless asked for (``docs/gpu.md``).
    """
    if precision is not None:
        return precision
    name = str(accelerator).lower()
    gpu = name in _GPU or (name == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if gpu else "32-true"


def build_trainer(cfg: DictConfig, callbacks: list[Any] | None = None) -> L.Trainer:
    """Instantiate the Trainer of a config with the strategy, loggers and standard callbacks."""
    run_dir = cfg.run_dir
    loggers: list[Any] = []
    if cfg.logger.csv:
        loggers.append(CSVLogger(run_dir, name="", version="csv"))
    if cfg.logger.tensorboard:
        loggers.append(TensorBoardLogger(run_dir, name="", version="tensorboard"))
    checkpoint = ModelCheckpoint(
        dirpath=f"{run_dir}/checkpoints",
        save_last=cfg.checkpoint.save_last,
        save_top_k=0,
        every_n_train_steps=cfg.checkpoint.every_n_train_steps,
    )
    all_callbacks = [RunSummary(run_dir), checkpoint, *(callbacks or [])]
    if loggers:
        all_callbacks.append(LearningRateMonitor(logging_interval="step"))
    precision = trainer_precision(cfg.trainer.get("precision"), cfg.trainer.get("accelerator", "auto"))
    if cfg.trainer.get("precision") is None:
        rank_zero_info(f"dynmo-train: trainer.precision is unset: training in {precision} (on GPUs bf16-mixed)")
    return instantiate(
        cfg.trainer,
        precision=precision,
        strategy=instantiate(cfg.strategy),
        callbacks=all_callbacks,
        logger=loggers or False,
        default_root_dir=run_dir,
        num_nodes=torchrun_num_nodes(cfg.trainer.get("num_nodes", 1)),  # an elastic restart's world
        _convert_="partial",
    )


def run(cfg: DictConfig) -> float | None:
    """Train one configuration; returns the final training loss (for Hydra sweepers)."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model, _convert_="all")
    trainer = build_trainer(cfg, build_callbacks(cfg))
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    # The end-of-training state, whatever the checkpoint schedule (every process takes part in writing it).
    trainer.save_checkpoint(f"{cfg.run_dir}/checkpoints/final.ckpt", weights_only=False)  # the whole state
    summary = next(c for c in trainer.callbacks if isinstance(c, RunSummary))
    return summary.losses[-1] if summary.losses else None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _train_main(cfg: DictConfig) -> float | None:
    _pin_multirun_job()
    OmegaConf.resolve(cfg)
    # A setting refused before training (a config that does not build, or one the launching process finds
    # contradicting the job's size) is one line and exit status 2; other errors keep their traceback.
    try:
        with fresh_world():  # the next job of a multirun starts a world of its own in this same process
            return run(cfg)
    except InstantiationException as e:
        raise SystemExit(_usage_error(str(e))) from None
    except Exception as e:
        if getattr(e, "refused_before_launch", False):
            raise SystemExit(_usage_error(f"{type(e).__name__}: {e}")) from None
        raise


def train() -> None:
    """Console script ``dynmo-train``."""
    _train_main()


def _usage_error(message: str) -> int:
    print(f"dynmo-train: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    train()


def export(argv: list[str] | None = None) -> None:
    """``dynmo-export CKPT OUT``: the unsplit model's ``state_dict`` of a checkpoint as one ``torch.save`` file.

    ``CKPT`` is a sharded checkpoint directory or a single file; the result loads into the plain model with
    ``model.load_state_dict(torch.load(OUT), strict=True)``. ``--full`` writes the whole single-file Lightning
    checkpoint instead (optimizer states by parameter name, loops, callbacks), which resumes like any other.
    ``--hf`` writes a model built with ``from_hf`` as a Hugging Face checkpoint directory instead
    (``save_pretrained``; loads with ``from_pretrained(OUT)``).
    """
    parser = argparse.ArgumentParser(prog="dynmo-export", description=export.__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint written by DynMoStrategy (directory or file)")
    parser.add_argument("out", help="the file to write")
    parser.add_argument("--full", action="store_true", help="the whole checkpoint, not only the state_dict")
    parser.add_argument("--hf", action="store_true", help="a Hugging Face directory (models built with from_hf)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.checkpoint):
        raise SystemExit(f"dynmo-export: {args.checkpoint} does not exist")
    try:
        whole = sharded.load_whole(args.checkpoint)
    except CheckpointRefused as e:  # a crafted file: one clear line, nothing of it ran
        raise SystemExit(f"dynmo-export: {e}") from None
    if args.hf:
        _export_hf(whole, args.out)
        return
    torch.save(whole if args.full else whole["state_dict"], args.out)
    print(f"dynmo-export: wrote {args.out} ({len(whole['state_dict'])} tensors)")


def _export_hf(whole: dict[str, Any], out: str) -> None:
    """Write the checkpoint of a ``from_hf`` model with ``save_pretrained``."""
    from dynmo_lightning.models.hf import save_hf

    hf_config = whole.get("hyper_parameters", {}).get("hf_config")
    if hf_config is None:
        raise SystemExit("dynmo-export --hf: the checkpoint is not of a model built with from_hf (no hf_config)")
    left = save_hf(whole["state_dict"], hf_config, out)
    note = f"; left out {len(left)} tensors of dynamic parts Hugging Face models lack: {left[:4]}" if left else ""
    print(f"dynmo-export: wrote the Hugging Face model to {out}{note}")
