"""Every expert's weights of one matrix side by side in one block of memory, read as one tensor and cast once a step.

:class:`~dynmo_lightning.models.moe.MoEMLP` keeps each matrix's weights (and biases) of all its experts in one block,
each expert's parameter a view of its slice (:func:`share_storage`), so that the grouped GEMM reads the block as one
``(E, out, in)`` tensor (:func:`experts_tensor`) instead of stacking a copy of every expert's weights per call.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

#: Each block's cast under autocast, by its first parameter: made once and shared by the calls of a step, as
#: autocast caches a linear layer's cast weight (every micro-batch in flight would otherwise save a copy of all
#: experts' weights). Held weakly: it lives while a graph saves it, not between steps.
_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def experts_tensor(params: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``torch.stack(params).to(dtype)``: a view of their block where they share one (:func:`share_storage`).

    A cast is made once while the parameters stay the same (same storage, place, version and ``requires_grad``):
    each call of a training step gets the same one.
    """
    if torch.compiler.is_compiling():
        return torch.stack(params).to(dtype)  # dynamo reads no storages: a compiled layer stacks, as before
    if params[0].dtype == dtype or not torch.is_grad_enabled():
        return _stacked(params).to(dtype)
    storages = [p.untyped_storage() for p in params]
    key = (dtype, tuple((p.storage_offset(), p._version, p.requires_grad) for p in params))
    cached = _CASTS.get(params[0])
    same = cached is not None and cached[0] == key and all(r() is s for r, s in zip(cached[1], storages, strict=True))
    cast = cached[2]() if same else None
    if cast is None:
        cast = _stacked(params).to(dtype)
        _CASTS[params[0]] = (key, [weakref.ref(s) for s in storages], weakref.ref(cast))
    return cast


def _stacked(params: list[Tensor]) -> Tensor:
    """``torch.stack(params)``, as a view of their block where they share one (:func:`share_storage`)."""
    block = _block(params)
    return torch.stack(params) if block is None else _BlockView.apply(block, *params)


def share_storage(params: list[Tensor]) -> None:
    """Give ``params`` (of one shape, dtype and device) one block of memory, each its slice, values kept.

    The parameters stay the same objects (optimizers, hooks and checkpoint keys see no change). Sharded parameters
    (DTensors) are left alone: FSDP2 owns their storage.
    """
    first = params[0]
    if any(isinstance(p, DTensor) for p in params) or _block(params) is not None:
        return
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in params):
        return  # experts pruned to different widths: they run one by one
    block = torch.empty((len(params), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for p, view in zip(params, block, strict=True):
            view.copy_(p)
            p.data = view


def _block(params: list[Tensor]) -> Tensor | None:
    """The ``(len(params), ...)`` block ``params`` are consecutive slices of, or ``None``."""
    first = params[0]
    if isinstance(first, DTensor) or not first.is_contiguous():
        return None
    size = first.numel()
    end = (first.storage_offset() + len(params) * size) * first.element_size()
    if first.untyped_storage().nbytes() < end:
        return None
    block = first.detach().as_strided((len(params), *first.shape), (size, *first.stride()), first.storage_offset())
    return block if all(p.is_set_to(view) for p, view in zip(params, block, strict=True)) else None


class _BlockView(torch.autograd.Function):
    """``torch.stack`` of tensors that are the slices of one block, without the copy: the block itself.

    Backward hands each tensor its slice of the gradient.
    """

    @staticmethod
    def forward(ctx: Any, block: Tensor, *params: Tensor) -> Tensor:
        return block

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *grad.unbind(0))
