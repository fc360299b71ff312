"""Token routing inside a transformer block: token early exit and Mixture of Depths, with real compute savings.

Both keep the block's *interface* fixed — hidden states ``(B, T, C)`` in and out — so activations between pipeline
stages keep a static shape, and change only how many tokens the block computes on:

* **Early exit** (:class:`ExitGate`, :func:`active_forward`): a token whose representation has saturated (the cosine
  similarity between its state entering and leaving a block reaches the gate's threshold) stops being processed. Its
  exit-time state flows on unchanged (later tokens still attend to it, the head scores it). Later blocks compute the
  attention *queries* and the MLP only for active tokens (gather, compute, scatter); keys and values are computed for
  all tokens, since active tokens attend to exited ones.
* **Mixture of Depths** (:class:`DepthRouter`, :func:`routed_forward`): each sequence sends only its top-k tokens by
  router score (``k = ceil(capacity * T)``) through the block; the others skip it through the residual. The routed
  tokens form a shorter sequence (in position order, causal among themselves). The block's contribution is multiplied
  by ``w = sigmoid(r) / stopgrad(sigmoid(r))`` — exactly 1 in value, the router weight's gradient in backward — so the
  router learns which tokens profit from the block, and at capacity 1 the block is *exactly* the dense block. The
  router (and the predictor) score the layer-normalised hidden states (no affine parameters): on the raw residual
  stream, whose scale grows, the router's weights grow with it and routing stops learning.
  Top-k over a sequence looks ahead, so for causal generation an auxiliary predictor (a linear probe on stop-gradient
  inputs, trained with BCE to predict top-k membership) decides routing without looking ahead; training and
  validation here use the top-k (the predictor's loss joins the auxiliary loss), as in Raposo et al. (2024).

Gates and routers are submodules of their block, so thresholds, capacities and router weights are layer state: they
migrate and checkpoint with the block. Statistics are not updated during shape probes (:func:`is_probing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.core.context import is_probing, stage_memo
from dynmo_lightning.core.host_values import host_value, set_host_value


class ExitGate(nn.Module):
    """Decides after a block which active tokens exit (hidden-state saturation criterion).

    ``threshold`` is a buffer (checkpointed, migrates); above 1 nothing can exit. ``may_exit`` says whether exits are
    allowed after this block at all (``min_layers`` / ``exit_every`` of the callback). ``exited`` / ``processed``
    accumulate token counts (tensors on the device, never read in the step) for the exit histogram until the callback
    reads and resets them. ``sync`` says how often blocks read the number of active tokens from the device (see
    :func:`active_bound`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("threshold", torch.tensor(2.0))
        self.may_exit = False
        self.sync = "auto"
        self.exited: Tensor | int = 0
        self.processed: Tensor | int = 0

    def reset_buffers(self) -> None:
        """No exits until a schedule sets a threshold (also after materialisation from the meta device)."""
        set_host_value(self, "threshold", 2.0)

    def pipeline_unused_parameters(self) -> bool:
        """Always: a block may get none of a step's tokens (they exited before it), and its parameters no gradient.

        DDP replicas then look for unused parameters, as one process needs no gradient for them either.
        """
        return True

    def forward(self, before: Tensor, after: Tensor, active: Tensor) -> Tensor:
        """The new active mask (float 1/0, ``(B, T)``) after a block turned ``before`` into ``after``."""
        if not self._open():
            return active
        active, exited, processed = self._exits(before, after, active)
        self._count(exited, processed)
        return active

    # In a compiled layer the host state stays out of the graphs: traced, dynamo would guard on the threshold, the
    # stage memo's bound, the counters' types and whether shapes are being probed, and compile again whenever one of
    # them changed. So ``_open`` and ``_count`` run eagerly (graph breaks) and ``_exits``, the computation, compiles:
    # a method of its own, so that it compiles even where dynamo runs ``forward`` eagerly (its frame breaks before any
    # operation).

    @torch.compiler.disable(reason="host state: the threshold's host value and the stage's memo")
    def _open(self) -> bool:
        """Whether tokens may exit after this block now; if so, the stage's later blocks learn that some may leave."""
        if not self.may_exit or host_value(self, "threshold") > 1.0:
            return False
        memo = stage_memo()
        if memo is not None and "active_bound" in memo:
            memo["active_bound"] = (memo["active_bound"][0], False)  # tokens may leave: still a bound, not all active
        return True

    def _exits(self, before: Tensor, after: Tensor, active: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The new active mask, the tokens that left and the tokens that were active."""
        with torch.no_grad():
            saturated = F.cosine_similarity(before, after, dim=-1) >= self.threshold
            was_active = active > 0
            leaving = saturated & was_active
            return active * (~leaving).to(active.dtype), leaving.sum(), was_active.sum()

    @torch.compiler.disable(reason="host state: the counters (an int after a reset) and whether shapes are probed")
    def _count(self, exited: Tensor, processed: Tensor) -> None:
        if not is_probing():  # a shape probe or a recomputation repeats a forward already counted
            self.exited = self.exited + exited
            self.processed = self.processed + processed


#: How often blocks read their active-token bound from the device (see :func:`active_bound`).
EXIT_SYNC = ("auto", "stage", "layer")

#: Active-token bounds are rounded up to a multiple of ``T // EXIT_BUCKETS`` when read once per stage, so that the
#: gathered shapes (and the kernels and allocations that follow them) repeat from micro-batch to micro-batch.
EXIT_BUCKETS = 16


def reads_per_layer(sync: str, device: torch.device) -> bool:
    """Whether blocks read their exact active-token counts (``"layer"``) rather than once per stage (``"stage"``).

    ``"auto"`` reads per layer on the CPU, where a read does not stall a device stream, and per stage elsewhere.

    Raises:
        ValueError: an unknown ``sync``.
    """
    if sync not in EXIT_SYNC:
        raise ValueError(f"dynamics.sync={sync!r} must be 'auto', 'stage' or 'layer'")
    return sync == "layer" or (sync == "auto" and device.type == "cpu")


@torch.compiler.disable(reason="host state: a read of the device, or the bound the stage's memo holds")
def active_bound(active: Tensor, sync: str = "auto") -> tuple[int, bool]:
    """The most active tokens of any sequence (an upper bound) and whether every token is active.

    One host read (one synchronisation on an accelerator) of both numbers. Read per stage (:func:`reads_per_layer`
    false, the default on accelerators), it happens once per stage forward (:func:`~dynmo_lightning.protocol.
    stage_forward`) and later blocks of the stage reuse the bound, which stays valid because tokens only exit; it is
    rounded up to a bucket (:data:`EXIT_BUCKETS`). Read per layer, every block reads its exact count, so it computes
    only the tokens still active.

    In a compiled layer it runs eagerly (a graph break, where the read is one anyway): the numbers enter the compiled
    code as inputs, which dynamo makes dynamic once it met a few, where traced it would guard on the memo's values.
    """
    per_stage = not reads_per_layer(sync, active.device)
    memo = stage_memo()
    if per_stage and memo is not None and "active_bound" in memo:
        return memo["active_bound"]
    T = active.shape[1]
    counts = (active > 0).sum(1)
    most, least = torch.stack([counts.max(), counts.min()]).tolist()
    if per_stage:
        step = max(1, T // EXIT_BUCKETS)
        most = min(T, -(-most // step) * step)
    bound = (most, least == T)
    if memo is not None:
        memo["active_bound"] = bound
    return bound


class DepthRouter(nn.Module):
    """Mixture-of-Depths router of one block: scores tokens and keeps the top ``capacity`` fraction.

    Args:
        n_embd: hidden size.
        capacity: fraction of each sequence's tokens the block processes (a buffer; schedules anneal it).
        predictor_coef: weight of the causal predictor's BCE loss in the auxiliary loss.
    """

    def __init__(self, n_embd: int, capacity: float = 0.125, predictor_coef: float = 0.01) -> None:
        super().__init__()
        self.router = nn.Linear(n_embd, 1, bias=False)
        self.predictor = nn.Linear(n_embd, 1)
        self.initial_capacity = float(capacity)
        self.register_buffer("capacity", torch.tensor(float(capacity)))
        self.predictor_coef = predictor_coef
        self.routed = 0
        self.seen = 0

    def reset_buffers(self) -> None:
        """Start from the configured capacity (also after materialisation from the meta device)."""
        set_host_value(self, "capacity", self.initial_capacity)

    def pipeline_whole_backward(self) -> bool:
        """Always: the predictor learns from the detached hidden states, which a split backward's passes miss."""
        return True

    def pipeline_unused_parameters(self) -> bool:
        """Always: at capacity 1 every token goes through the block and the router gets no gradient.

        DDP replicas then look for unused parameters (a schedule anneals the capacity while the replicas run).
        """
        return True

    @staticmethod
    def normalise(h: Tensor) -> Tensor:
        """What the router and the predictor score: the hidden states layer-normalised, without affine parameters.

        The residual stream's scale grows with depth and training. A router on the raw stream, whose weight is 1 in
        value (only its gradient flows), grows with it and turns routing into noise: at 12 blocks, capacity 0.5
        trained to a validation loss of 3.33 against 2.72 dense; on the normalised stream, 2.73.
        """
        return F.layer_norm(h, h.shape[-1:])

    def scores(self, h: Tensor) -> Tensor:
        """Router logits ``(B, T)`` of hidden states ``(B, T, C)``; each sequence's top-k by them go through."""
        return self.router(self.normalise(h)).squeeze(-1)

    def top(self, logits: Tensor) -> Tensor:
        """The positions ``(B, k)`` each sequence sends through the block, in sequence order."""
        return logits.topk(self.k(logits.shape[1]), dim=1).indices.sort(dim=1).values

    @torch.compiler.disable(reason="host state: token counts (ints) and whether shapes are probed")
    def count(self, routed: int, seen: int) -> None:
        """Add a forward's routed and seen tokens (not a shape probe's or a recomputation's: counted already).

        Host state only, so in a compiled layer it runs eagerly: traced, dynamo would guard on the counts and compile
        again at every call.
        """
        if not is_probing():
            self.routed += routed
            self.seen += seen

    def k(self, seq_len: int) -> int:
        """Tokens per sequence the block processes (the capacity is read from the device only after it changed)."""
        return max(1, min(seq_len, math.ceil(host_value(self, "capacity") * seq_len)))


def attend_queries(attn: nn.Module, x: Tensor, pos: Tensor) -> Tensor:
    """Causal self-attention outputs of the query positions ``pos`` ``(B, A)`` only; keys/values from all of ``x``.

    ``attn`` is the block's attention module (:class:`~dynmo_lightning.models.blocks.CausalSelfAttention`); the
    result is ``(B, A, C)``, the attention branch of the queried tokens (after the output projection).
    """
    T = x.shape[1]
    xq = x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))
    q, k, v = attn.qkv(x, xq)
    mask = torch.arange(T, device=x.device)[None, None, None, :] <= pos[:, None, :, None]
    return attn.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def active_forward(
    block: nn.Module,
    h: Tensor,
    active: Tensor,
    mlp: Callable[..., tuple[Tensor, Tensor | None]],
    bound: int,
    exact: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Run ``block`` on its active tokens only (``active`` ``(B, T)`` float 1/0); exited tokens pass unchanged.

    ``bound`` is at least the largest number of active tokens in any sequence (:func:`active_bound`): sequences are
    padded to it, so the cost falls with it. ``exact`` (counts read per layer, :func:`reads_per_layer`): the MLP runs
    on exactly the active tokens, a boolean gather whose size is a host read. Otherwise it runs on the padded rows
    (no read): a row-wise MLP computes the padding too, and an MLP that routes tokens (MoE) is told which rows are
    real (``mlp(x, valid)``) where it can take a mask without reading the device (``mlp.masks_on_device``), else it
    gets the gathered tokens. Returns the new hidden states and the MLP's auxiliary loss (MoE), if any.
    """
    C = h.shape[-1]
    mask = active > 0
    counts = mask.sum(1)
    A = bound
    if A == 0:
        return h, None
    # Active positions first (in order), padded with inactive ones whose results are discarded.
    pos = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :A]
    valid = torch.arange(A, device=h.device)[None, :] < counts[:, None]
    index = pos[..., None].expand(-1, -1, C)
    # A block with its own attention layout (Hugging Face layers: rotary, grouped KV) says how to attend.
    attend = getattr(block, "attend_queries", None) or (lambda x, p: attend_queries(block.attn, x, p))
    x = h.gather(1, index) + attend(block.ln1(h), pos)
    inner = getattr(block, "mlp", None)  # Hugging Face layers keep their MLP elsewhere (row-wise: no routing)
    routes = getattr(inner, "routes_tokens", False)
    if routes and not exact and inner.masks_on_device(x):
        delta, aux = mlp(block.ln2(x), valid)
        x = x + delta
    elif exact or routes:
        flat = x[valid]
        delta, aux = mlp(block.ln2(flat))
        x = x.masked_scatter(valid[..., None], flat + delta)
    else:
        delta, aux = mlp(block.ln2(x))
        x = x + delta
    x = torch.where(valid[..., None], x, h.gather(1, index))
    return h.scatter(1, index, x), aux


def routed_forward(
    block: nn.Module, router: DepthRouter, h: Tensor, dense: Callable[[Tensor], tuple[Tensor, Tensor | None]]
) -> tuple[Tensor, Tensor | None]:
    """Mixture of Depths: ``dense`` (the block's own computation) on each sequence's top-k tokens only.

    Returns the new hidden states and the auxiliary loss (the block's own, plus the causal predictor's BCE).
    """
    B, T, C = h.shape
    if host_value(router, "capacity") >= 1.0:
        return dense(h)  # every token routed: exactly the dense block
    # Below capacity 1 the router and its predictor always join the loss (even if k rounds up to T), so whether the
    # carried auxiliary loss needs gradients depends on the capacity alone — stage metadata stays valid.
    k = router.k(T)
    normed = router.normalise(h)
    logits = router.router(normed).squeeze(-1)
    top = router.top(logits)
    index = top[..., None].expand(-1, -1, C)
    x = h.gather(1, index)
    y, aux = dense(x)
    # sigmoid(r) / stopgrad(sigmoid(r)) in log space: sigmoid underflows to 0 for r below about -100 (logits of the
    # deep residual stream get there), and 0 / 0 would turn the step's loss into NaN.
    log_s = F.logsigmoid(logits.gather(1, top))
    out = x + (y - x) * torch.exp(log_s - log_s.detach())[..., None]
    target = torch.zeros_like(logits).scatter(1, top, 1.0)
    bce = F.binary_cross_entropy_with_logits(router.predictor(normed.detach()).squeeze(-1), target)
    router.count(B * k, B * T)
    aux = router.predictor_coef * bce if aux is None else aux + router.predictor_coef * bce
    return h.scatter(1, index, out), aux
