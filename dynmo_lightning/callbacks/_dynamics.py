"""Pieces shared by the dynamics callbacks: enabling a model's dynamic structure, finding its parts, gathering stats."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from dynmo_lightning.protocol import all_gather, local_layers


def enable(pl_module: pl.LightningModule, part: type[nn.Module], setting: str, **options: Any) -> None:
    """Ask the model to build its layers with ``options`` (before ``configure_model``), then check ``part`` exists.

    Models that build dynamic parts themselves (no ``configure_dynamics``) just need to contain ``part`` modules.

    Raises:
        ValueError: the model has no ``part`` modules after all (naming the model setting that adds them).
    """
    configure = getattr(pl_module, "configure_dynamics", None)
    if callable(configure):
        configure(**options)
    elif not parts(pl_module, part):
        raise ValueError(
            f"{type(pl_module).__name__} has no {part.__name__} modules in its pipeline layers: build the model with "
            f"{setting} (the reference GPT's configure_dynamics does it for you)"
        )


def parts(pl_module: pl.LightningModule, part: type[nn.Module]) -> list[tuple[int, nn.Module]]:
    """``(layer index, module)`` of every ``part`` module in the layers this process holds."""
    if getattr(pl_module, "blocks", ...) is None:  # layers not built yet
        return []
    return [(i, m) for i, layer in local_layers(pl_module) for m in layer.modules() if isinstance(m, part)]


def gather(local: dict[int, Any], trainer: pl.Trainer) -> dict[int, Any]:
    """Merge ``{layer index: value}`` of every process (each holds different layers).

    Values are statistics of the data (numbers, tensors or tuples of them): with data-parallel replicas, which see
    different data, each layer's value is the mean over the replicas (they train on equal numbers of samples).
    """
    by_replica = all_gather(local, trainer, replicas=True)
    merged = [{i: v for part_ in replica for i, v in part_.items()} for replica in by_replica]
    return {i: _mean([m[i] for m in merged]) for i in merged[0]}


def _mean(values: list[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    first = values[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_mean(list(parts)) for parts in zip(*values, strict=True))
    if isinstance(first, torch.Tensor):
        return torch.stack([v.float() for v in values]).mean(0)
    if isinstance(first, (int, float)):
        return sum(values) / len(values)
    return first
