"""Pieces shared by the dynamics callbacks: enabling a model's dynamic structure, finding its parts, gathering stats."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
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


def gather(local: dict[int, Any]) -> dict[int, Any]:
    """Merge ``{layer index: value}`` of every process (each holds different layers)."""
    return {i: v for part_ in all_gather(local) for i, v in part_.items()}
