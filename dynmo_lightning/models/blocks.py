"""The transformer parts every model here is built from: embedding, attention, MLP, block, head.

Kept apart from the models so that ``gpt.py`` (the reference GPT), ``moe.py`` (whose experts are :class:`MLP` s) and
``sparse_attention.py`` (a :class:`CausalSelfAttention` subclass) all import these parts and never each other: the
imports run one way, blocks → moe / sparse_attention → gpt. A :class:`Block` can route its tokens (early exit, Mixture
of Depths; :mod:`dynmo_lightning.models.routing`); its attention may be sparse and its MLP a Mixture of Experts, both
passed in by the model that builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from dynmo_lightning.models.routing import (
    DepthRouter,
    ExitGate,
    active_bound,
    active_forward,
    reads_per_layer,
    routed_forward,
)
from dynmo_lightning.optim import index_select_


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` token ids to ``(B, T, C)`` hidden states.

    With ``carry=True`` (a model with dynamic structure) it starts the carried state ``(hidden, active, aux)``: all
    tokens active, no auxiliary loss yet.
    """

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float, carry: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.carry = carry

    def forward(self, idx: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Embed token ids ``(B, T)``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.drop(self.wte(idx) + self.wpe(pos))
        if not self.carry:
            return h
        return h, torch.ones(idx.shape, dtype=h.dtype, device=h.device), torch.zeros(idx.shape[0], device=h.device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on ``(B, T, C)`` hidden states.

    Queries, keys and values have a projection each (``q``, ``k``, ``v``; keys without a bias, which could not change
    an attention weight), laid out head by head, so that a tensor
    parallel split of their rows (``ColwiseParallel``) gives every process whole heads of all three, and one of
    ``proj``'s columns (``RowwiseParallel``) the same heads (``pipeline/parallel/tensor_parallel.py``). The forward
    counts the heads it got from the projections' widths: the same code runs whole or split.

    Structured pruning removes whole heads (:meth:`keep_units`): the projections shrink, so attention costs fall
    with the number of heads left. A checkpoint of the fused layout of earlier versions (``qkv``, rows
    ``[3, n_head, head_dim]``) loads into the three projections.
    """

    unit_kind = "head"

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.initial_units = n_head
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_head * self.head_dim, bias=bias)
        # No key bias: it adds q . b to every logit of a query alike, which softmax removes. Its gradient is zero in
        # exact arithmetic; in float it is noise, which Adam would turn into steps of the learning rate's size.
        self.k = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.v = nn.Linear(n_embd, n_head * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def heads(self, projected: Tensor) -> Tensor:
        """``(B, T, h * head_dim)`` projections as ``(B, h, T, head_dim)``: ``h`` the heads this process holds."""
        B, T, width = projected.shape
        return projected.view(B, T, width // self.head_dim, self.head_dim).transpose(1, 2)

    def qkv(self, x: Tensor, xq: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of ``xq`` (default: ``x``), keys and values of ``x``, each ``(B, h, T, head_dim)``."""
        return self.heads(self.q(x if xq is None else xq)), self.heads(self.k(x)), self.heads(self.v(x))

    def merge(self, y: Tensor) -> Tensor:
        """Attention outputs ``(B, h, T, head_dim)`` through the output projection (and dropout): ``(B, T, C)``."""
        B, h, T, D = y.shape
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, h * D)))

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally over ``(B, T, C)``."""
        q, k, v = self.qkv(x)
        p = self.dropout if self.training else 0.0
        return self.merge(F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True))

    def _rows(self, heads: Tensor) -> Tensor:
        """Rows of ``q``, ``k`` and ``v`` (laid out ``[n_head, head_dim]``) that belong to ``heads``, in order."""
        d = torch.arange(self.head_dim, device=heads.device)
        return (heads[:, None] * self.head_dim + d).reshape(-1)

    def _projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q, self.k, self.v

    def unit_scores(self) -> Tensor:
        """L2 norm of each head's query/key/value rows and output-projection columns."""
        per_head = torch.zeros(self.n_head, device=self.q.weight.device)
        for lin in self._projections():
            rows = lin.weight.detach().square().sum(1)
            if lin.bias is not None:
                rows = rows + lin.bias.detach().square()
            per_head = per_head + rows.view(self.n_head, self.head_dim).sum(1)
        cols = self.proj.weight.detach().square().sum(0).view(self.n_head, self.head_dim).sum(1)
        return (per_head + cols).sqrt()

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only the heads ``keep`` (ascending indices), slicing weights and their optimizer state in place."""
        rows = self._rows(keep)
        for lin in self._projections():
            index_select_(lin.weight, 0, rows, optimizers)
            if lin.bias is not None:
                index_select_(lin.bias, 0, rows, optimizers)
        index_select_(self.proj.weight, 1, rows, optimizers)
        self._set_heads(len(keep))

    def _set_heads(self, n_head: int) -> None:
        self.n_head = n_head
        for lin in self._projections():
            lin.out_features = n_head * self.head_dim
        self.proj.in_features = n_head * self.head_dim

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        _split_fused_qkv(state_dict, prefix)
        # A checkpoint of a pruned model has fewer heads: take its shapes before its values.
        w = state_dict.get(prefix + "q.weight")
        if w is not None and w.shape != self.q.weight.shape:
            heads = w.shape[0] // self.head_dim
            for lin in self._projections():
                _resize(lin.weight, tuple(w.shape))
                if lin.bias is not None:
                    _resize(lin.bias, (w.shape[0],))
            _resize(self.proj.weight, (self.proj.weight.shape[0], heads * self.head_dim))
            self._set_heads(heads)
        super()._load_from_state_dict(state_dict, prefix, *args)


def _split_fused_qkv(state_dict: dict[str, Any], prefix: str) -> None:
    """A fused ``qkv`` projection of earlier versions (rows ``[3, n_head, head_dim]``) as ``q``, ``k`` and ``v``.

    The key part of its bias is left out: it moves every logit of a query alike, which changes no attention weight.
    """
    for kind in ("weight", "bias"):
        fused = state_dict.pop(prefix + "qkv." + kind, None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3, dim=0), strict=True):
                if not (name == "k" and kind == "bias"):
                    state_dict[f"{prefix}{name}.{kind}"] = part


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU.

    Structured pruning removes hidden neurons (:meth:`keep_units`): both matrices shrink, so the MLP's cost falls with
    the fraction of neurons kept.
    """

    unit_kind = "neuron"

    def __init__(self, n_embd: int, hidden: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.initial_units = hidden
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP position-wise."""
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def unit_scores(self) -> Tensor:
        """L2 norm of each hidden neuron's input row, bias and output column."""
        score = self.fc.weight.detach().square().sum(1) + self.proj.weight.detach().square().sum(0)
        if self.fc.bias is not None:
            score = score + self.fc.bias.detach().square()
        return score.sqrt()

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only the hidden neurons ``keep`` (ascending), slicing weights and their optimizer state in place."""
        index_select_(self.fc.weight, 0, keep, optimizers)
        if self.fc.bias is not None:
            index_select_(self.fc.bias, 0, keep, optimizers)
        index_select_(self.proj.weight, 1, keep, optimizers)
        self.fc.out_features = self.proj.in_features = len(keep)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A checkpoint of a pruned model has fewer neurons: take its shapes before its values.
        w = state_dict.get(prefix + "fc.weight")
        if w is not None and w.shape != self.fc.weight.shape:
            hidden = w.shape[0]
            _resize(self.fc.weight, tuple(w.shape))
            if self.fc.bias is not None:
                _resize(self.fc.bias, (hidden,))
            _resize(self.proj.weight, (self.proj.weight.shape[0], hidden))
            self.fc.out_features = self.proj.in_features = hidden
        super()._load_from_state_dict(state_dict, prefix, *args)


def _resize(param: nn.Parameter, shape: tuple[int, ...]) -> None:
    """Give ``param`` a new shape in place (values follow from the state dict being loaded)."""
    param.data = param.data.new_empty(shape)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Takes plain hidden states ``(B, T, C)``, or — in a model with dynamic structure — the carried state
    ``(hidden, active, aux)``: the active-token mask of early exit (``(B, T)``, 1/0) and each sample's share of the
    auxiliary losses so far (``(B,)``; MoE and Mixture-of-Depths add to it). Optional parts, all layer state:
    ``exit_gate`` (token early exit), ``depth_router`` (Mixture of Depths); ``attn`` may be sparse and ``mlp`` a
    Mixture of Experts (its forward then returns ``(output, aux_loss)``).
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        mlp_hidden: int,
        dropout: float,
        bias: bool,
        *,
        attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
        early_exit: bool = False,
        mod_capacity: float | None = None,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = attn if attn is not None else CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = mlp if mlp is not None else MLP(n_embd, mlp_hidden, dropout, bias)
        self.exit_gate = ExitGate() if early_exit else None
        self.depth_router = DepthRouter(n_embd, mod_capacity) if mod_capacity is not None else None

    def _mlp(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        out = self.mlp(x) if valid is None else self.mlp(x, valid)
        return out if isinstance(out, tuple) else (out, None)

    def _dense(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        x = x + self.attn(self.ln1(x))
        m, aux = self._mlp(self.ln2(x))
        return x + m, aux

    def forward(
        self, h: Tensor, active: Tensor | None = None, aux: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Apply the block to hidden states ``(B, T, C)``, or to the carried state ``(hidden, active, aux)``."""
        if active is None or aux is None:
            return self._dense(h)[0]
        if self.depth_router is not None:
            y, extra = routed_forward(self, self.depth_router, h, self._dense)
        elif self.exit_gate is not None:
            bound, all_active = active_bound(active, self.exit_gate.sync)
            exact = reads_per_layer(self.exit_gate.sync, active.device)
            y, extra = self._dense(h) if all_active else active_forward(self, h, active, self._mlp, bound, exact)
        else:
            y, extra = self._dense(h)
        if self.exit_gate is not None:
            active = self.exit_gate(h, y, active)
        if extra is not None:
            # Each sample carries an equal share, so the sum over a micro-batch is the block's auxiliary loss.
            aux = aux + extra / h.shape[0]
        return y, active, aux


class Head(nn.Module):
    """Final layer norm and projection to vocabulary logits (plus the carried auxiliary loss, if any)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(
        self, h: Tensor, active: Tensor | None = None, aux: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``(B, T, V)``, or ``(logits, aux)`` for a carried state."""
        logits = self.lm_head(self.ln_f(h))
        return logits if aux is None else (logits, aux)
