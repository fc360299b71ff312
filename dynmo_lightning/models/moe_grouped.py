"""The grouped-GEMM path of :class:`~dynmo_lightning.models.moe.MoEMLP`: padded token groups, grouped linear layers.

All experts of a matrix run as one ``grouped_mm`` over device-side offsets, so the experts' loads never reach the host;
under ``torch.compile`` outside bf16 the GEMM runs as the opaque custom op :func:`grouped_mm_op`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.models.moe_storage import experts_tensor


def group_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Rows each expert's group of a grouped GEMM starts at a multiple of: 16 bytes of rows on CUDA, else 1.

    torchtitan pads the token groups to 8 rows in bf16 for torch's CUDA kernel, whose backward slices 2-D operands at
    the offsets. The wheel holds no source that says the kernel needs no alignment (the meta checks,
    ``_meta_grouped_mm_common`` in ``torch/_meta_registrations.py``, look at strides only), so CUDA pads; the CPU
    kernel loops over the groups and needs nothing (padding there would only cost rows).
    """
    return 16 // dtype.itemsize if device.type == "cuda" else 1


def gemm_dtype(x: Tensor) -> torch.dtype:
    """The dtype the grouped GEMMs run in: autocast's where it is on (as a linear layer's), else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def padded_groups(kept: Tensor, n: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of the grouped GEMMs when each expert's group starts at a multiple of ``align`` rows.

    Args:
        kept: assignments each expert computes; they come first in the order of ``n`` assignments, by expert.
        n: assignments in that order.
        align: the groups' alignment in rows.

    Returns:
        Per row (``n + (align - 1) * E`` of them: the most padding takes, so no size is read from the device), the
        position in the order of the assignment it computes (any valid one for a padding row); whether it computes
        one; and the groups' ends (``int32`` offsets).
    """
    padded = (kept + align - 1) // align * align
    ends = padded.cumsum(0)
    row = torch.arange(n + (align - 1) * len(kept), device=kept.device)
    group = torch.searchsorted(ends, row, right=True).clamp(max=len(kept) - 1)
    within = row - (ends - padded)[group]
    real = within < kept[group]
    first = kept.cumsum(0) - kept
    return (first[group] + within).clamp(0, n - 1), real, ends.to(torch.int32)


def grouped_linear(x: Tensor, linears: list[nn.Linear], expert: Tensor, offsets: Tensor, keep: Tensor) -> Tensor:
    """``linears[expert[i]](x[i])`` for the kept rows (grouped by expert, ``offsets`` their ends); zero elsewhere.

    Rows past the last offset are not computed: their outputs (and, in backward, their gradients) are whatever
    memory held, so both ends are masked.
    """
    # Under autocast a linear layer computes in the autocast dtype; the grouped GEMM is cast the same way.
    dtype = gemm_dtype(x)
    weight = experts_tensor([lin.weight for lin in linears], dtype).transpose(1, 2)  # (E, in, out): x @ W.T
    x = torch.where(keep[:, None], x, 0.0)
    out = _grouped_mm(x.to(dtype), weight, offsets)
    if linears[0].bias is not None:
        out = out + experts_tensor([lin.bias for lin in linears], out.dtype).index_select(0, expert)
    return torch.where(keep[:, None], out, 0.0)


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)``; under ``torch.compile`` outside bf16, as the opaque :func:`grouped_mm_op`.

    Dynamo runs every op on fake tensors first, and torch's fake ``grouped_mm`` accepts bf16 only (its checks are
    the CUDA kernel's), while the CPU kernel also runs fp32: traced in place, a compiled fp32 MoE layer fails. In bf16
    the op stays visible to the compiler (which has kernels of its own for it on GPUs); eager calls are unchanged.
    """
    if torch.compiler.is_compiling() and not a.dtype == b.dtype == torch.bfloat16:
        return grouped_mm_op(a, b, offs)
    return F.grouped_mm(a, b, offs=offs)


@torch.library.custom_op("dynmo::grouped_mm", mutates_args=())
def grouped_mm_op(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as an op of its own, with a fake implementation for any dtype.

    ``a`` is ``(M, K)`` with its rows grouped by ``offs`` (the groups' ends); ``b`` is ``(E, K, N)`` (one matrix a
    group: ``(M, N)`` out), or ``(M, N)`` with ``offs`` grouping the contraction (the weights' gradient: ``(E, K, N)``
    out, ``a`` then ``(K, M)``).
    """
    return F.grouped_mm(a, b, offs=offs)


@grouped_mm_op.register_fake
def _grouped_mm_shape(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_save(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    # Per group g: out_g = a_g @ b_g, so grad a_g = grad_g @ b_g.T and grad b_g = a_g.T @ grad_g (offs then group the
    # contraction). The kernel refuses broadcast gradients (zero strides): contiguous.
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = grouped_mm_op(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_op(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)
