"""Structured pruning of Hugging Face decoder layers: the prunable units of their MLPs and attentions.

What ``GradualPruning`` needs (its ``PrunableUnits`` protocol), for the GPT-2 and Llama families.

A unit view (:class:`Units`) is a parameterless module that stands beside the Hugging Face module it prunes (it does
not register it, so parameters and state-dict keys stay the Hugging Face ones). Pruning slices the weights and their
optimizer state in place; the Hugging Face ``forward`` takes head counts from the weights' shapes, so the layer keeps
running unchanged, and cheaper.

* Gated MLP (Llama, Mistral, Qwen2): a neuron is a row of ``gate_proj`` and ``up_proj`` and a column of
  ``down_proj``, removed together.
* Grouped-query attention: the unit is a KV group, one key/value head with the query heads that share it, so the
  ratio of query to KV heads (which the attention kernels rely on) never changes; with as many KV heads as query
  heads it is one head.
* GPT-2: MLP neurons (``c_fc`` columns, ``c_proj`` rows of its ``Conv1D`` s) and heads (``c_attn`` columns of the
  query, key and value parts, ``c_proj`` rows).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dynmo_lightning.optim import index_select_


class Units(nn.Module):
    """Prunable units of ``target`` (held, not registered: the target's parameters stay where they are)."""

    unit_kind = "unit"

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.__dict__["target"] = target
        self.initial_units = self.n_units()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The target's parameters (where callers find the units' device); the module tree never lists them here."""
        return self.target.parameters() if recurse else iter(())

    def n_units(self) -> int:
        """Units left."""
        raise NotImplementedError

    def unit_scores(self) -> Tensor:
        """L2 norm of each unit's weights (rows and columns of every matrix it owns, biases included).

        One reduction per part on the weights' device: the energy of every row (or column) along the part's dimension,
        gathered into ``(units, indices)`` and summed per unit in the order of the unit's own indices.
        """
        device, n = self._device(), self.n_units()
        total = torch.zeros(n, device=device)
        for p, dim, index in self._parts(torch.arange(n, device=device)):
            square = p.detach().float().square()
            energy = square.sum([d for d in range(p.dim()) if d != dim]) if p.dim() > 1 else square
            rows = index.movedim(-2, 0).reshape(n, -1)
            total = total + energy.index_select(0, rows.reshape(-1)).view(n, -1).sum(1)
        return total.sqrt()

    def _device(self) -> torch.device:
        return next(self.target.parameters()).device

    def _parts(self, keep: Tensor) -> list[tuple[nn.Parameter, int, Tensor]]:
        """``(parameter, dim, indices along dim)`` belonging to units ``keep`` (on the parameters' device).

        The indices have shape ``(..., len(keep), width)``: the unit axis is second to last, so flattened they are the
        indices along ``dim`` in ascending order (for ascending ``keep``), and moved to the front each row holds one
        unit's indices.
        """
        raise NotImplementedError

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only units ``keep`` (ascending), slicing weights and their optimizer state in place."""
        for p, dim, index in self._parts(keep.to(self._device())):
            index_select_(p, dim, index.reshape(-1), optimizers)
        self.sync()

    def sync(self) -> None:
        """Update the target's size attributes from its weights' shapes (after pruning or loading)."""
        raise NotImplementedError

    def fit_shapes(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Give the target the shapes ``state_dict`` has under ``prefix`` (a pruned checkpoint), values to follow."""
        for name, p in self.target.named_parameters():
            w = state_dict.get(prefix + name)
            if w is not None and w.shape != p.shape:
                p.data = p.data.new_empty(tuple(w.shape))
        self.sync()


def _spans(units: Tensor, width: int, offset: int = 0) -> Tensor:
    """Indices ``(len(units), width)`` of ``width``-wide blocks ``units``, shifted by ``offset`` (on their device)."""
    return offset + units.unsqueeze(1) * width + torch.arange(width, device=units.device)


class GatedMLPUnits(Units):
    """Neurons of a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``)."""

    unit_kind = "neuron"

    def n_units(self) -> int:
        """Hidden neurons left."""
        return self.target.gate_proj.weight.shape[0]

    def _parts(self, keep: Tensor) -> list[tuple[nn.Parameter, int, Tensor]]:
        mlp, rows = self.target, keep.unsqueeze(1)
        parts = [(mlp.gate_proj.weight, 0, rows), (mlp.up_proj.weight, 0, rows), (mlp.down_proj.weight, 1, rows)]
        parts += [(lin.bias, 0, rows) for lin in (mlp.gate_proj, mlp.up_proj) if lin.bias is not None]
        return parts

    def sync(self) -> None:
        """Linear sizes and ``intermediate_size`` from the weights."""
        mlp = self.target
        n = self.n_units()
        mlp.gate_proj.out_features = mlp.up_proj.out_features = mlp.down_proj.in_features = n
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = n


class GroupedHeadUnits(Units):
    """KV groups of a Llama-family attention: one key/value head with its query heads (``q/k/v/o_proj``)."""

    unit_kind = "kv_group"

    def n_units(self) -> int:
        """KV heads left."""
        return self.target.k_proj.weight.shape[0] // self.target.head_dim

    def _parts(self, keep: Tensor) -> list[tuple[nn.Parameter, int, Tensor]]:
        attn = self.target
        D = attn.head_dim
        per_group = attn.q_proj.weight.shape[0] // attn.k_proj.weight.shape[0]
        kv, q = _spans(keep, D), _spans(keep, per_group * D)
        parts = [(attn.q_proj.weight, 0, q), (attn.k_proj.weight, 0, kv), (attn.v_proj.weight, 0, kv)]
        parts.append((attn.o_proj.weight, 1, q))
        parts += [(lin.bias, 0, r) for lin, r in ((attn.q_proj, q), (attn.k_proj, kv), (attn.v_proj, kv)) if
                  lin.bias is not None]  # fmt: skip
        return parts

    def sync(self) -> None:
        """Linear sizes and head counts from the weights (transformers < 5 reads ``num_heads``)."""
        attn = self.target
        q, kv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        attn.q_proj.out_features = attn.o_proj.in_features = q
        attn.k_proj.out_features = attn.v_proj.out_features = kv
        for name, value in (("num_heads", q // attn.head_dim), ("num_key_value_heads", kv // attn.head_dim)):
            if hasattr(attn, name):
                setattr(attn, name, value)


class Conv1DMLPUnits(Units):
    """Neurons of GPT-2's MLP (``c_fc`` columns and bias, ``c_proj`` rows)."""

    unit_kind = "neuron"

    def n_units(self) -> int:
        """Hidden neurons left."""
        return self.target.c_fc.weight.shape[1]

    def _parts(self, keep: Tensor) -> list[tuple[nn.Parameter, int, Tensor]]:
        mlp, rows = self.target, keep.unsqueeze(1)
        return [(mlp.c_fc.weight, 1, rows), (mlp.c_fc.bias, 0, rows), (mlp.c_proj.weight, 0, rows)]

    def sync(self) -> None:
        """``Conv1D.nf`` from the weights."""
        self.target.c_fc.nf = self.n_units()


class GPT2HeadUnits(Units):
    """Heads of GPT-2's attention (``c_attn`` query/key/value columns and bias, ``c_proj`` rows)."""

    unit_kind = "head"

    def n_units(self) -> int:
        """Heads left."""
        return self.target.c_proj.weight.shape[0] // self.target.head_dim

    def _parts(self, keep: Tensor) -> list[tuple[nn.Parameter, int, Tensor]]:
        attn = self.target
        D, S = attn.head_dim, attn.c_proj.weight.shape[0]
        cols = torch.stack([_spans(keep, D, c * S) for c in range(3)])  # query, key, value parts: (3, units, D)
        return [(attn.c_attn.weight, 1, cols), (attn.c_attn.bias, 0, cols), (attn.c_proj.weight, 0, _spans(keep, D))]

    def sync(self) -> None:
        """``split_size``, ``num_heads`` and ``Conv1D.nf`` from the weights."""
        attn = self.target
        S = attn.c_proj.weight.shape[0]
        attn.split_size = S
        attn.num_heads = S // attn.head_dim
        attn.c_attn.nf = 3 * S


def mlp_units(mlp: nn.Module) -> Units | None:
    """The unit view of a Hugging Face MLP (``None``: a kind this module cannot prune)."""
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return GatedMLPUnits(mlp)
    if hasattr(mlp, "c_fc") and hasattr(mlp, "c_proj"):
        return Conv1DMLPUnits(mlp)
    return None


def attention_units(attn: nn.Module) -> Units | None:
    """The unit view of a Hugging Face attention (``None``: a kind this module cannot prune)."""
    if all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
        return GroupedHeadUnits(attn)
    if hasattr(attn, "c_attn") and not getattr(attn, "is_cross_attention", False):
        return GPT2HeadUnits(attn)
    return None
