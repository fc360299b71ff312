"""Shared pieces of the example benchmarks: one timed training run under DynMoStrategy, in a world of its own.

Benchmarks run under ``torchrun`` so that every Trainer of an invocation reuses the same processes (policies then
alternate A B A B in one invocation and machine drift cancels); each Trainer trains in a fresh world
(``dynmo_lightning.launch.fresh_world``), which is up while the caller measures more inside ``with fit(...)``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as L

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.bench.real import Window
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import fresh_world
from dynmo_lightning.models import GPT


def world_size() -> int:
    """Processes of this torchrun job (known before the first Trainer initialises the process group)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def gpt_arguments(parser: argparse.ArgumentParser, *, layers: int, batch_help: str | None = None) -> None:
    """The options of an A/B benchmark of the reference GPT: steps, warm-up, repeats and the model's size."""
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--measure-from", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help=batch_help)


def gpt_config(args: argparse.Namespace, n_head: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The untied GPT and the data of :func:`gpt_arguments`' options, as :func:`fit` takes them."""
    model = {"n_layer": args.layers, "n_embd": args.hidden, "n_head": n_head, "block_size": args.block,
             "tie_embeddings": False}  # fmt: skip
    return model, {"block_size": args.block, "batch_size": args.batch}


@contextlib.contextmanager
def fit(
    model: dict[str, Any],
    data: dict[str, Any],
    callbacks: list[L.Callback],
    *,
    steps: int,
    measure_from: int,
    microbatches: int = 4,
    schedule: str = "1f1b",
    **settings: Any,
) -> Iterator[tuple[L.Trainer, float]]:
    """Train a GPT for ``steps`` steps in a fresh world; yields the trainer and tokens/s measured from ``measure_from``.

    The world (process group) is up inside the ``with`` block and ends when it does. ``settings``: more of the
    strategy's (``data_parallel_size``, ``data_parallel``, ...); tokens/s counts every replica's batch.
    """
    with fresh_world():
        L.seed_everything(0)
        timer = Window(measure_from)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size(),
            max_steps=steps,
            strategy=DynMoStrategy(n_microbatches=microbatches, schedule=schedule, **settings),
            callbacks=[timer, *callbacks],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        datamodule = StdlibCharDataModule(max_bytes=2_000_000, **data)
        trainer.fit(GPT(**model), datamodule=datamodule)
        replicas = int(settings.get("data_parallel_size", 1))
        yield trainer, replicas * timer.steps * datamodule.tokens_per_batch / timer.seconds
