"""Calling pipeline layers: a tuple output becomes the next layer's arguments; frozen prefixes run without autograd."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn


def as_tuple(x: Any) -> tuple[Any, ...]:
    """Normalise a layer's input/output to a tuple (layers may pass a tensor or a tuple of tensors)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def call_layer(layer: nn.Module, x: Any) -> Any:
    """Apply one layer; a tuple input is unpacked into positional arguments.

    A frozen layer (``layer.pipeline_frozen``) whose inputs carry no gradient runs without autograd: nothing before
    it trains, so nothing needs its backward - even when it uses a parameter tied to a layer that keeps training (a
    token embedding tied to the head learns through the head alone once the embedding is frozen).
    """
    call = (lambda: layer(*x)) if isinstance(x, tuple) else (lambda: layer(x))
    if runs_without_autograd(layer, x):
        with torch.no_grad():
            return call()
    return call()


def run_layers(layers: Sequence[nn.Module], x: Any) -> Any:
    """Apply ``layers`` in order (:func:`call_layer`); a tuple output becomes the next layer's arguments."""
    for layer in layers:
        x = call_layer(layer, x)
    return x


def runs_without_autograd(layer: nn.Module, x: Any) -> bool:
    """Whether :func:`call_layer` runs ``layer`` on ``x`` without autograd: it is frozen and ``x`` has no gradient."""
    return getattr(layer, "pipeline_frozen", False) and not any(
        isinstance(t, Tensor) and t.requires_grad for t in as_tuple(x)
    )
