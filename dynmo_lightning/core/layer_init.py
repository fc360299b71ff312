"""Seeded layer initialisation: layer ``i`` gets the same weights on any stage and device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dynmo_lightning.core.model import ProtocolError

_SEED_STRIDE = 1_000_003


def layer_seed(base_seed: int, index: int) -> int:
    """The seed that initialises layer ``index``: the same wherever (on whichever stage) the layer is built."""
    return (base_seed * _SEED_STRIDE + index) % (2**63 - 1)


def init_layer(module: Any, index: int, layer: nn.Module, base_seed: int) -> None:
    """Initialise layer ``index`` deterministically from ``base_seed`` and its index, on the CPU.

    Uses ``module.pipeline_init_layer(index, layer)`` when the module defines it, else every submodule's
    ``reset_parameters()``, with the CPU generator seeded from :func:`layer_seed`: a layer on an accelerator is
    initialised on the host and copied back (in place: the parameters stay the same objects), because devices' own
    generators differ (CUDA's from the CPU's, and between GPU models), and layer ``i`` must get the same weights on
    any stage and device. The global RNG state is left untouched.

    Raises:
        ProtocolError: a submodule owns parameters but the layer cannot be re-initialised.

    """
    device = next((t.device for t in layer.parameters()), torch.device("cpu"))
    if device.type not in ("cpu", "meta"):
        layer.to("cpu")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(base_seed, index))
            _reset(module, index, layer)
    finally:
        if device.type not in ("cpu", "meta"):
            layer.to(device)


def materialise_layer(module: Any, index: int, layer: nn.Module, base_seed: int, device: torch.device) -> None:
    """Give meta-device layer ``index`` storage on ``device``, initialised on the host (:func:`init_layer`)."""
    layer.to_empty(device="cpu")
    init_layer(module, index, layer, base_seed)
    if torch.device(device).type != "cpu":
        layer.to(device)


def _reset(module: Any, index: int, layer: nn.Module) -> None:
    hook = getattr(module, "pipeline_init_layer", None)
    if callable(hook):
        hook(index, layer)
        return
    for sub in layer.modules():
        owns_params = any(True for _ in sub.parameters(recurse=False))
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        elif owns_params:
            raise ProtocolError(
                f"Layer {index} ({type(layer).__name__}) was created on the meta device but its submodule "
                f"{type(sub).__name__} has parameters and no `reset_parameters()`. Define "
                f"`pipeline_init_layer(index, layer)` on {type(module).__name__} to initialise a layer in place."
            )
