"""Dynamic block-sparse causal self-attention, a drop-in for the GPT's :class:`CausalSelfAttention`.

The sequence is split into blocks of ``attn_block`` positions. Query block ``i`` (0-based) attends to
``k_i = max(1, floor(density * (i + 1) + 0.5))`` of its ``i + 1`` causal key blocks: always its own (diagonal) block,
causally masked inside, plus the ``k_i - 1`` earlier blocks ``j < i`` with the highest score
``mean-pooled q of block i · mean-pooled k of block j``, chosen per batch element and head (ties: the earlier block).
Only the kept blocks are computed: key/value blocks are gathered and each query block runs dense attention over its
own gathered keys, so attention cost falls in proportion to the kept share of the causal blocks. ``k_i`` never
decreases with ``i``, so query blocks with equal ``k_i`` form contiguous runs, each computed as one batch.

When every causal block is kept (``density=1``, a single block, or rounding keeps all), the layer runs exactly
:meth:`CausalSelfAttention.forward`, so its output is bit-identical to the dense layer with the same weights.

Adaptive density (``target_coverage`` set, training, not :func:`~dynmo_lightning.protocol.is_probing`): each forward
estimates *coverage*, the share of the exact causal attention mass that falls in its kept blocks, from one sampled
query row per query block (the block's last row, which sees all of its causal keys), averaged over rows, heads and
batch; that costs ``1 / attn_block`` of dense attention, runs without autograd and stays on the device. After the
training step, :func:`adapt_densities` reads the step's coverages once and moves each density by
``adapt_rate * (target_coverage - coverage)`` per forward, clamped to ``[min_density, 1]``: more blocks when attention
spreads out, fewer when it concentrates, so densities differ across layers and drift during training.

``density`` is a persistent buffer, so it is checkpointed and migrates with the layer. The parameter names are those
of :class:`CausalSelfAttention`: a dense checkpoint loads strictly into this class (the layer keeps its own
``density``); loading this class's state dict into the dense class needs ``strict=False`` (the extra ``density``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dynmo_lightning.core.context import is_probing
from dynmo_lightning.core.host_values import host_value, read_once, set_host_value
from dynmo_lightning.models.blocks import CausalSelfAttention


class SparseCausalSelfAttention(CausalSelfAttention):
    """Causal self-attention over data-dependent key blocks, with optionally self-tuning density.

    Head pruning (:meth:`keep_units`) is inherited: a pruned layer stays block-sparse.

    Args:
        n_embd: hidden size.
        n_head: attention heads.
        dropout: attention and residual dropout probability.
        bias: whether the projections have biases.
        attn_block: block size along the sequence; the sequence length must be a multiple of it (or at most it).
        density: initial fraction of the causal key blocks each query block keeps, in ``(0, 1]``.
        target_coverage: attention-mass coverage the adaptive density aims for, in ``(0, 1]``; ``None`` keeps the
            density fixed.
        min_density: lower bound of the adaptive density.
        adapt_rate: step of the adaptive density per training forward, per unit of coverage error.

    Attributes:
        density: the current density (a scalar float32 buffer).
        last_coverage: mean coverage of the last adapted step's forwards (1.0 when every block was kept; ``nan``
            until measured).
        last_block_fraction: share of the causal key blocks computed in the last forward (the layer's relative cost).

    Raises:
        ValueError: a setting is out of range (the message names it).

    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float,
        bias: bool,
        attn_block: int = 64,
        density: float = 1.0,
        target_coverage: float | None = None,
        min_density: float = 0.05,
        adapt_rate: float = 0.1,
    ) -> None:
        super().__init__(n_embd, n_head, dropout, bias)
        if attn_block < 1:
            raise ValueError(f"model.attn_block={attn_block} must be at least 1")
        if not 0 < density <= 1:
            raise ValueError(f"model.attn_density={density} must be in (0, 1]")
        if target_coverage is not None and not 0 < target_coverage <= 1:
            raise ValueError(f"model.attn_target_coverage={target_coverage} must be in (0, 1] (or None)")
        if not 0 < min_density <= 1:
            raise ValueError(f"SparseCausalSelfAttention(min_density={min_density}) must be in (0, 1]")
        if adapt_rate < 0:
            raise ValueError(f"SparseCausalSelfAttention(adapt_rate={adapt_rate}) must be >= 0")
        self.attn_block = attn_block
        self.initial_density = density
        self.target_coverage = target_coverage
        self.min_density = min_density
        self.adapt_rate = adapt_rate
        self.register_buffer("density", torch.tensor(density, dtype=torch.float32))
        self.last_coverage = math.nan
        self.last_block_fraction = 1.0
        # Coverage measured by this step's forwards, summed on the device until :meth:`adapt` reads it once.
        self._coverage_sum: Tensor | float = 0.0
        self._coverage_n = 0

    def reset_buffers(self) -> None:
        """Restore the initial density (e.g. after the layer was materialised from the meta device)."""
        set_host_value(self, "density", self.initial_density)

    # The protocol's default initialisation calls every submodule's reset_parameters (the weights live in q/k/v/proj).
    reset_parameters = reset_buffers

    def blocks_kept(self, n_blocks: int) -> list[int]:
        """Key blocks ``k_i`` kept by each of ``n_blocks`` query blocks at the current density."""
        d = host_value(self, "density")
        return [max(1, min(i + 1, math.floor(d * (i + 1) + 0.5))) for i in range(n_blocks)]

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally over ``(B, T, C)``, computing only the kept key blocks."""
        B, T, _ = x.shape
        if T > self.attn_block and T % self.attn_block:
            raise ValueError(
                f"sequence length {T} is not a multiple of model.attn_block={self.attn_block}; use a block_size that "
                "is a multiple of attn_block, or a smaller attn_block"
            )
        n_blocks = max(1, T // self.attn_block)
        kept = self.blocks_kept(n_blocks)
        if sum(kept) == n_blocks * (n_blocks + 1) // 2:
            # Every block kept: the dense layer's own code path, so outputs are bit-identical to it.
            self._adapt(1.0, 1.0)
            return super().forward(x)

        q, k, v = self.qkv(x)
        H, D, blk = q.shape[1], self.head_dim, self.attn_block
        qb, kb, vb = (t.reshape(B * H, n_blocks, blk, D) for t in (q, k, v))
        with torch.no_grad():
            rank = _rank_earlier_blocks(qb.mean(2), kb.mean(2))
        rows = torch.arange(B * H, device=x.device)[:, None, None]
        p = self.dropout if self.training else 0.0
        outputs = []
        start = 0
        for n_kept, count in _runs(kept):
            end = start + count
            # Earlier blocks by rank, the diagonal block last: one causal mask fits the whole run.
            diag = torch.arange(start, end, device=x.device).expand(B * H, count)[..., None]
            idx = torch.cat([rank[:, start:end, : n_kept - 1], diag], -1)
            keys, values = (t[rows, idx].reshape(B, H * count, n_kept * blk, D) for t in (kb, vb))
            queries = qb[:, start:end].reshape(B, H * count, blk, D)
            mask = torch.ones(blk, n_kept * blk, dtype=torch.bool, device=x.device)
            mask[:, (n_kept - 1) * blk :].tril_()
            y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, dropout_p=p)
            outputs.append(y.reshape(B, H, count, blk, D))
            start = end
        y = torch.cat(outputs, 2).reshape(B, H, T, D)

        coverage: Tensor | float = math.nan
        if self._adapting():
            with torch.no_grad():
                coverage = _coverage(q, k, rank, kept, blk)
        self._adapt(coverage, sum(kept) / (n_blocks * (n_blocks + 1) / 2))
        return self.merge(y)

    def _adapting(self) -> bool:
        return self.target_coverage is not None and self.training and not is_probing()

    def _adapt(self, coverage: Tensor | float, block_fraction: float) -> None:
        """Record the last forward's statistics; sum its coverage (on the device) for this step's :meth:`adapt`."""
        if is_probing():
            return
        self.last_block_fraction = block_fraction
        if self._adapting():
            self._coverage_sum = self._coverage_sum + coverage
            self._coverage_n += 1

    def adapt(self) -> None:
        """Move the density towards the target coverage after a training step (see :func:`adapt_densities`)."""
        adapt_densities([self])

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A dense CausalSelfAttention checkpoint has no density: keep this layer's own rather than fail strict loads.
        if prefix + "density" not in state_dict and prefix + "density" in missing_keys:
            missing_keys.remove(prefix + "density")

    def extra_repr(self) -> str:
        """Settings shown in the module's repr."""
        return (
            f"attn_block={self.attn_block}, density={host_value(self, 'density'):.3f}, "
            f"target_coverage={self.target_coverage}"
        )


def adapt_densities(layers: Iterable[SparseCausalSelfAttention]) -> None:
    """Apply the step's density updates of ``layers`` with one device read for all of them.

    Each layer's density moves by ``adapt_rate * sum_f (target_coverage - coverage_f)`` over the step's adaptive
    forwards ``f`` (one per micro-batch), clamped to ``[min_density, 1]``, and ``last_coverage`` becomes their mean.
    Updating once per step (not after every forward) keeps the density, and so the layer's shapes and cost, the same
    for all micro-batches of a step, and costs one host synchronisation per stage and step instead of one per layer
    and micro-batch. Models call it after each training step (``GPT`` does in ``on_train_batch_end``).
    """
    pending = [m for m in layers if m._coverage_n]
    for m, total in zip(pending, read_once([m._coverage_sum for m in pending]), strict=True):
        n, target = m._coverage_n, m.target_coverage
        assert target is not None  # only adaptive layers measure coverage
        m.last_coverage = total / n
        density = host_value(m, "density") + m.adapt_rate * (n * target - total)
        set_host_value(m, "density", min(1.0, max(m.min_density, density)))
        m._coverage_sum, m._coverage_n = 0.0, 0


def _rank_earlier_blocks(q_pooled: Tensor, k_pooled: Tensor) -> Tensor:
    """Earlier key blocks of every query block, best pooled score first.

    Args:
        q_pooled: mean-pooled queries ``(BH, n_blocks, D)``.
        k_pooled: mean-pooled keys, same shape.

    Returns:
        ``(BH, n_blocks, n_blocks)`` block indices; row ``i`` starts with blocks ``j < i`` by descending score (ties:
        the earlier block), followed by the blocks ``j >= i``.

    """
    scores = q_pooled @ k_pooled.transpose(1, 2)
    n = scores.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril(-1)
    scores = scores.masked_fill(~earlier, -math.inf)
    return scores.sort(dim=-1, descending=True, stable=True).indices


def _runs(kept: list[int]) -> list[tuple[int, int]]:
    """``(value, length)`` of each run of equal consecutive values in ``kept``."""
    runs: list[tuple[int, int]] = []
    for n in kept:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def _coverage(q: Tensor, k: Tensor, rank: Tensor, kept: list[int], blk: int) -> Tensor:
    """Share of exact causal attention mass inside the kept blocks, from the last query row of every block.

    Args:
        q: queries ``(B, H, T, D)``.
        k: keys ``(B, H, T, D)``.
        rank: block ranking from :func:`_rank_earlier_blocks`, ``(B * H, n_blocks, n_blocks)``.
        kept: key blocks kept per query block.
        blk: block size.

    """
    B, H, T, D = q.shape
    n = T // blk
    rows = q[:, :, blk - 1 :: blk].reshape(B * H, n, D)
    logits = rows @ k.reshape(B * H, T, D).transpose(1, 2) / math.sqrt(D)
    # The last row of block i sees exactly the key blocks 0..i.
    visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().repeat_interleave(blk, 1)
    mass = logits.masked_fill(~visible, -math.inf).softmax(-1).view(B * H, n, n, blk).sum(-1)
    # Kept: the diagonal block and the first k_i - 1 of row i's ranking (all earlier blocks, as k_i <= i + 1), marked
    # run by run with host slices: nothing made from the host list on the device.
    in_kept = torch.eye(n, dtype=torch.bool, device=q.device).expand(B * H, n, n).clone()
    start = 0
    for n_kept, count in _runs(kept):
        if n_kept > 1:
            block_rows = slice(start, start + count)
            in_kept[:, block_rows].scatter_(-1, rank[:, block_rows, : n_kept - 1], True)
        start += count
    return (mass * in_kept).sum(-1).mean()
