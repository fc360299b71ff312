"""Hugging Face decoder parts as self-contained pipeline layers: embedding, decoder layer, final norm + head.

Each layer needs nothing but the activation it receives: a decoder layer computes its rotary positions (with its own
copy of the model's rotary module, which has no trainable parameters) and its causal mask from the hidden states, so
any contiguous run of layers is a valid pipeline stage. The Hugging Face modules run their own ``forward``; these
wrappers only supply what the Hugging Face model's ``forward`` would have passed them.

Two families share this code (:data:`FAMILIES`): GPT-2 (learned positions, fused ``Conv1D`` attention) and Llama
(rotary positions, RMSNorm, gated MLP, grouped KV heads; Mistral and Qwen2 have the same layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.core.host_values import host_value
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.models.hf.units import attention_units, mlp_units
from dynmo_lightning.models.routing import DepthRouter, ExitGate

#: Attention implementations whose causal mask a layer builds itself (``sdpa``: none, the kernel's ``is_causal``).
ATTENTION = ("sdpa", "eager")


@dataclasses.dataclass(frozen=True)
class Family:
    """Where a family keeps its parts in the Hugging Face causal LM (dotted paths from the top module)."""

    name: str
    wte: str
    wpe: str | None
    layers: str
    norm: str
    rotary: str | None
    ln1: str
    ln2: str
    attn: str


FAMILIES = {
    "gpt2": Family("gpt2", "transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", None,
                   "ln_1", "ln_2", "attn"),
    "llama": Family("llama", "model.embed_tokens", None, "model.layers", "model.norm", "model.rotary_emb",
                    "input_layernorm", "post_attention_layernorm", "self_attn"),
}  # fmt: skip

#: ``config.model_type`` of every supported model, and its family.
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


class Embedding(nn.Module):
    """Token embedding (plus GPT-2's learned positions and dropout): ``(B, T)`` ids to ``(B, T, C)``.

    With ``carry`` (early exit or Mixture of Depths on) it starts the carried state ``(hidden, active, aux)``.
    """

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding | None = None, drop: nn.Module | None = None) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop if drop is not None else nn.Identity()
        self.carry = False

    def forward(self, input_ids: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Embed token ids ``(B, T)``."""
        h = self.wte(input_ids)
        if self.wpe is not None:
            h = h + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device)[None])
        h = self.drop(h)
        if not self.carry:
            return h
        shape, device = input_ids.shape, h.device
        return h, torch.ones(shape, dtype=h.dtype, device=device), torch.zeros(shape[0], device=device)


class DecoderLayer(nn.Module):
    """One Hugging Face decoder layer that computes its own positions and causal mask.

    Args:
        layer: the Hugging Face decoder layer (``LlamaDecoderLayer``, ``GPT2Block``, ...).
        family: its family.
        rotary: a copy of the model's rotary module (``None``: learned positions, GPT-2).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (the layer's config says which it runs).
        sliding_window: the attention window of the layer, if any (longer sequences are refused).

    Dynamic parts, all layer state (they migrate and checkpoint with the layer): ``exit_gate`` (token early exit)
    and ``depth_router`` (Mixture of Depths); structured pruning sees ``mlp_units`` and ``attn_units``.
    """

    def __init__(
        self,
        layer: nn.Module,
        family: Family,
        rotary: nn.Module | None,
        attn_implementation: str,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if attn_implementation not in ATTENTION:
            raise ValueError(
                f"attn_implementation={attn_implementation!r} is not supported for pipeline layers; load the model "
                f"with attn_implementation in {list(ATTENTION)}"
            )
        self.layer = layer
        self.rotary = rotary
        self.family = family
        self.attn_implementation = attn_implementation
        self.sliding_window = sliding_window
        self.mlp_units = mlp_units(layer.mlp)
        self.attn_units = attention_units(getattr(layer, family.attn))
        self.exit_gate: ExitGate | None = None
        self.depth_router: DepthRouter | None = None
        self._routed_positions: Tensor | None = None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A checkpoint of a pruned layer has fewer units: take its shapes before its values.
        for units, path in ((self.mlp_units, "mlp"), (self.attn_units, self.family.attn)):
            if units is not None:
                units.fit_shapes(state_dict, f"{prefix}layer.{path}.")
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def ln1(self) -> nn.Module:
        """The norm in front of attention (what :func:`~dynmo_lightning.models.routing.active_forward` calls)."""
        return getattr(self.layer, self.family.ln1)

    @property
    def ln2(self) -> nn.Module:
        """The norm in front of the MLP."""
        return getattr(self.layer, self.family.ln2)

    def _mask(self, h: Tensor) -> Tensor | None:
        T = h.shape[1]
        if self.sliding_window is not None and T > self.sliding_window:
            raise ValueError(
                f"sequence length {T} exceeds the layer's sliding attention window {self.sliding_window}: pipeline "
                "layers build a plain causal mask; train with sequences no longer than the window"
            )
        if self.attn_implementation == "sdpa":
            return None  # the kernel's is_causal, as the Hugging Face model does without padding
        blocked = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)
        return torch.zeros(T, T, dtype=h.dtype, device=h.device).masked_fill(blocked, torch.finfo(h.dtype).min)[
            None, None
        ]

    def _dense(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """The Hugging Face layer on ``(B, T, C)`` (the whole sequence, or the tokens a depth router picked)."""
        kwargs: dict[str, Any] = {}
        if self.rotary is not None:
            positions = self._routed_positions
            if positions is None or positions.shape[1] != h.shape[1]:
                positions = torch.arange(h.shape[1], device=h.device)[None]
            kwargs["position_embeddings"] = self.rotary(h, positions)
        out = self.layer(h, attention_mask=self._mask(h), **kwargs)
        return (out[0] if isinstance(out, tuple) else out), None  # transformers < 5 returns a tuple

    def _mlp(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.layer.mlp(x), None

    def _pick_positions(self, h: Tensor) -> Tensor | None:
        """The places of the tokens ``routed_forward`` will pick (the same operations on the same input).

        Rotary positions of routed tokens must be their own places in the sequence, not ``0 .. k-1``.
        """
        router = self.depth_router
        if router is None or self.rotary is None or host_value(router, "capacity") >= 1.0:
            return None
        with torch.no_grad():
            return router.top(router.scores(h))

    def forward(
        self, h: Tensor, active: Tensor | None = None, aux: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Hidden states ``(B, T, C)``, or the carried state ``(hidden, active, aux)``: the reference block's routing.

        The reference :class:`~dynmo_lightning.models.blocks.Block` decides what runs (Mixture of Depths, early exit
        on the active tokens, or dense) through ``_dense``, ``_mlp``, ``ln1``/``ln2`` and ``attend_queries``.
        """
        self._routed_positions = self._pick_positions(h) if aux is not None else None
        try:
            return Block.forward(self, h, active, aux)
        finally:
            self._routed_positions = None

    def attend_queries(self, x: Tensor, pos: Tensor) -> Tensor:
        """Attention outputs of the query positions ``pos`` ``(B, A)`` only, keys/values from all of ``x``.

        What early exit computes for the active tokens (:func:`~dynmo_lightning.models.routing.active_forward`):
        ``x`` is the normed input ``(B, T, C)``, the result ``(B, A, C)`` the attention branch after its output
        projection.
        """
        attn = getattr(self.layer, self.family.attn)
        B, T, C = x.shape
        xq = x.gather(1, pos[..., None].expand(-1, -1, C))
        if self.family.name == "gpt2":
            q, k, v, scale, out = _gpt2_qkv(attn, x, xq)
        else:
            q, k, v, scale, out = _llama_qkv(attn, self.rotary, x, xq, pos)
        mask = torch.arange(T, device=x.device)[None, None, None, :] <= pos[:, None, :, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out(y.transpose(1, 2).reshape(B, pos.shape[1], -1))


def _gpt2_qkv(attn: nn.Module, x: Tensor, xq: Tensor) -> tuple[Tensor, Tensor, Tensor, float, Any]:
    """GPT-2's fused ``Conv1D`` projection, queries of ``xq`` only."""
    D, S = attn.head_dim, attn.split_size
    w, b = attn.c_attn.weight, attn.c_attn.bias
    q = torch.addmm(b[:S], xq.reshape(-1, xq.shape[-1]), w[:, :S]).view(*xq.shape[:2], -1, D).transpose(1, 2)
    kv = torch.addmm(b[S:], x.reshape(-1, x.shape[-1]), w[:, S:]).view(*x.shape[:2], 2, -1, D)
    k, v = kv.permute(2, 0, 3, 1, 4)
    scale = getattr(attn, "scaling", D**-0.5 if attn.scale_attn_weights else 1.0)
    return q, k, v, scale, lambda y: attn.resid_dropout(attn.c_proj(y))


def _llama_qkv(
    attn: nn.Module, rotary: nn.Module, x: Tensor, xq: Tensor, pos: Tensor
) -> tuple[Tensor, Tensor, Tensor, float, Any]:
    """Llama-family projections with rotary positions (queries at ``pos``) and grouped KV heads repeated."""
    D = attn.head_dim
    T = x.shape[1]
    q = attn.q_proj(xq).view(*xq.shape[:2], -1, D).transpose(1, 2)
    k = attn.k_proj(x).view(*x.shape[:2], -1, D).transpose(1, 2)
    v = attn.v_proj(x).view(*x.shape[:2], -1, D).transpose(1, 2)
    q = _rope(q, *rotary(x, pos))
    k = _rope(k, *rotary(x, torch.arange(T, device=x.device)[None]))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return q, k, v, attn.scaling, attn.o_proj


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``t`` ``(B, H, L, D)`` (the Hugging Face ``apply_rotary_pos_emb`` formula)."""
    cos, sin = cos[:, None], sin[:, None]
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


class Head(nn.Module):
    """Final norm and projection to vocabulary logits (plus the carried auxiliary loss, if any)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(
        self, h: Tensor, active: Tensor | None = None, aux: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``(B, T, V)``, or ``(logits, aux)`` for a carried state."""
        logits = self.lm_head(self.norm(h))
        return logits if aux is None else (logits, aux)
