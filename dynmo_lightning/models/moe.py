"""Mixture-of-Experts feed-forward layer that can replace the GPT's :class:`~dynmo_lightning.models.blocks.MLP`.

Every expert is a plain GPT ``MLP`` (``fc``, GELU, ``proj``), so expert weights in a checkpoint look like MLP weights,
and a learned router (``router``, no bias) sends each token to its top-k experts. Each expert runs only on the tokens
routed to it (gathered with ``index_select``, scattered back with ``index_add``): the layer's cost follows its routing,
which is what makes MoE blocks drift in cost during training and why DynMo re-balances them.

Routing rules:

- Router probabilities are a softmax over the experts (computed in float32).
- ``top_k=1`` (Switch): the token's output is its expert's output times the router probability of that expert (not
  renormalised, so the router gets a gradient through the output).
- ``top_k>=2`` (GShard): the chosen experts' probabilities are renormalised to sum to 1 over the chosen experts. The
  renormalisation happens before capacity is applied, so a dropped assignment simply contributes nothing; the
  token's remaining experts keep their weights.
- Capacity per expert is ``ceil(capacity_factor * N * top_k / n_experts)`` for ``N`` tokens in the call;
  ``capacity_factor=None`` is dropless. When an expert is over capacity it keeps the assignments with the highest
  router probability; ties go to the earlier token (then the earlier of its top-k slots), so routing is
  deterministic. A dropped assignment adds nothing for that token: the caller's residual connection carries it.

The returned auxiliary loss is the Switch-Transformer load-balancing loss plus the router z-loss (see
:meth:`MoEMLP.forward`); add it to the training loss.

Two ways to run the experts, the same routing:

- **grouped** (where ``torch.nn.functional.grouped_mm`` runs: the CPU, and CUDA at compute capability 8.0+ in
  bf16): all assignments sorted by expert, kept ones first, and two grouped GEMMs over device-side offsets. Rows past
  the last kept one are not computed, so the cost still follows the routing, and nothing is read from the device:
  the experts' loads never reach the host. A mask of the rows that are real tokens (early exit's padded rows) is
  applied on the device too. On CUDA every expert's group of rows starts at a multiple of 16 bytes of rows (8 in
  bf16, zero rows in between), as torchtitan pads them for torch's CUDA kernel (:func:`group_alignment`).
  The experts' weights (and biases) of one matrix sit side by side in one block of memory, each expert's parameter a
  view of its slice (:func:`~dynmo_lightning.models.moe_storage.share_storage`), so the GEMM reads the block as one
  ``(E, out, in)`` tensor: no stacked copy of every expert's weights per call. Under autocast the block is cast once
  while the weights stay the same, and every micro-batch of the step shares the cast (as autocast caches a linear
  layer's cast weight). Checkpoint keys and the per-expert path stay those of plain ``MLP`` experts. Where the block
  cannot be kept (FSDP2 shards, experts pruned apart) or read (a compiled layer), the weights are stacked per call.
  The grouped path's kernels live in :mod:`~dynmo_lightning.models.moe_grouped`, the block in
  :mod:`~dynmo_lightning.models.moe_storage`.
- **per expert** (elsewhere: fp32 or fp16 on a GPU): one ``index_select`` / MLP / ``index_add`` per expert, whose
  sizes are the one host read of the layer per call.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.core.context import is_probing
from dynmo_lightning.models.blocks import MLP
from dynmo_lightning.models.moe_grouped import gemm_dtype, group_alignment, grouped_linear, grouped_mm_op, padded_groups
from dynmo_lightning.models.moe_storage import share_storage

__all__ = ["MoEMLP", "group_alignment", "grouped_mm_op"]


class MoEMLP(nn.Module):
    """Top-k routed Mixture-of-Experts MLP with expert capacity, load-balancing loss and router z-loss.

    Args:
        n_embd: hidden size ``C`` of the tokens.
        hidden: hidden size of every expert MLP.
        n_experts: number of experts ``E``.
        top_k: experts per token (1 = Switch routing, 2 = GShard routing with renormalised weights).
        capacity_factor: expert capacity as a multiple of the even share ``N * top_k / E``; ``None`` never drops.
        aux_loss_coef: weight of the load-balancing loss ``E * sum_e f_e * P_e``.
        z_loss_coef: weight of the router z-loss ``mean(logsumexp(logits) ** 2)``.
        dropout: dropout of every expert MLP.
        bias: whether the expert linear layers have biases (the router never has one).

    Attributes:
        tokens_per_expert: assignments each expert computed in the last forward (after capacity drops).
        drop_fraction: share of the last forward's token assignments dropped for lack of capacity.

    Raises:
        ValueError: ``n_experts < 1``, ``top_k < 1``, ``top_k > n_experts`` or ``capacity_factor <= 0``.

    """

    #: Its output for a token depends on the other tokens of the call (capacity): callers pass only real tokens,
    #: or a mask of them where :meth:`masks_on_device` says so.
    routes_tokens = True

    def __init__(
        self,
        n_embd: int,
        hidden: int,
        n_experts: int,
        top_k: int = 1,
        capacity_factor: float | None = 1.25,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 1e-3,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if n_experts < 1:
            raise ValueError(f"model.n_experts={n_experts}: a mixture of experts needs at least one expert")
        if top_k < 1:
            raise ValueError(f"model.moe_top_k={top_k}: every token must be routed to at least one expert")
        if top_k > n_experts:
            raise ValueError(
                f"model.moe_top_k={top_k} > model.n_experts={n_experts}: a token cannot be routed to more experts "
                "than there are"
            )
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"model.moe_capacity_factor={capacity_factor} must be > 0 (or None for dropless routing)")
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(n_embd, hidden, dropout, bias) for _ in range(n_experts))
        self._group_experts()
        # A checkpoint of a pruned model resizes the experts' parameters: put them back into blocks after a load.
        self.register_load_state_dict_post_hook(_regroup_after_load)
        #: ``None``: the grouped GEMM wherever it runs (:meth:`masks_on_device`); ``False``: always per expert.
        self.grouped: bool | None = None
        # Plain attributes (not buffers): logging statistics that travel with the pickled module, not checkpointed.
        # Tensors on the device (read only when asked for), or host values.
        self._kept: Tensor | list[int] = [0] * n_experts
        self._assignments: Tensor | int = 0

    def _group_experts(self) -> None:
        """Put each matrix's weights (and biases) of all experts side by side in one block (see the module doc)."""
        for linear in ("fc", "proj"):
            for name in ("weight", "bias"):
                params = [getattr(getattr(e, linear), name) for e in self.experts]
                if params[0] is not None:
                    share_storage(params)

    def _apply(self, fn: Any, recurse: bool = True) -> MoEMLP:
        # ``to``, ``to_empty``, ``half``...: every parameter gets storage of its own, so group them again.
        super()._apply(fn, recurse)
        self._group_experts()
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled (a migrated layer, a deep copy): each parameter arrived in its own storage.
        super().__setstate__(state)
        self._group_experts()

    @property
    def tokens_per_expert(self) -> list[int]:
        """Assignments each expert computed in the last forward (after capacity drops); reads the device."""
        return self._kept.tolist() if isinstance(self._kept, Tensor) else list(self._kept)

    @property
    def drop_fraction(self) -> float:
        """Share of the last forward's token assignments dropped for lack of capacity; reads the device."""
        total = int(self._assignments)
        return 1.0 - sum(self.tokens_per_expert) / total if total else 0.0

    def pipeline_unused_parameters(self) -> bool:
        """Experts without tokens get no gradient on the per-expert path (grouped, every expert gets one)."""
        return not self.masks_on_device(next(self.parameters()))

    def masks_on_device(self, x: Tensor) -> bool:
        """Whether the experts run as grouped GEMMs on ``x`` here (then no host read, and masks work)."""
        if self.grouped is False or not hasattr(F, "grouped_mm"):
            return False
        if len({e.fc.weight.shape for e in self.experts}) > 1:
            return False  # experts pruned to different widths: one GEMM per expert
        if x.device.type == "cpu":
            return x.dtype in (torch.float32, torch.bfloat16)
        if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        return autocast or x.dtype == torch.bfloat16

    def capacity(self, n_tokens: int) -> int | None:
        """Most assignments one expert takes from a call with ``n_tokens`` tokens (``None``: unlimited)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Route tokens to their experts.

        Args:
            x: tokens ``(N, C)`` (e.g. only the tokens a caller selected) or hidden states ``(B, T, C)``.
            valid: which rows of ``x`` are real tokens (``x.shape[:-1]``, bool); the others are neither routed nor
                counted (only where :meth:`masks_on_device`).

        Returns:
            ``(y, aux)``: ``y`` has the shape of ``x`` (zero where every assignment of a token was dropped) and ``aux``
            is the scalar ``aux_loss_coef * E * sum_e f_e * P_e + z_loss_coef * mean(logsumexp(logits) ** 2)``, with
            ``f_e`` the fraction of token assignments routed to expert ``e`` (before capacity) and ``P_e`` the mean
            router probability of ``e``. ``aux`` is differentiable with respect to the router.

        Raises:
            ValueError: a mask where the experts do not run grouped.
        """
        flat = x.reshape(-1, x.shape[-1])
        mask = None if valid is None else valid.reshape(-1)
        n, k, n_exp = flat.shape[0], self.top_k, self.n_experts
        logits = self.router(flat).float()
        if n == 0:
            self._record([0] * n_exp, 0)
            # Keep the router in the graph so that callers can always backpropagate through ``aux``.
            return torch.zeros_like(x), logits.sum() * 0.0
        probs = logits.softmax(-1)
        top_p, top_e = probs.topk(k, dim=-1)
        gates = (top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)).reshape(-1)
        if self.masks_on_device(flat):
            y, routed, real = self._grouped_experts(flat, top_p.reshape(-1), top_e.reshape(-1), gates, mask)
        elif mask is not None:
            raise ValueError("MoEMLP takes a mask of real tokens only where its experts run grouped (masks_on_device)")
        else:
            (y, routed), real = self._expert_loop(flat, top_p.reshape(-1), top_e.reshape(-1), gates), n
        z = torch.logsumexp(logits, -1).square()
        if mask is None:
            mean_p, z_loss = probs.mean(0), z.mean()
        else:
            mean_p, z_loss = (probs * mask[:, None]).sum(0) / real, (z * mask).sum() / real
        balance = n_exp * (routed.float() / (real * k) * mean_p).sum()
        aux = self.aux_loss_coef * balance + self.z_loss_coef * z_loss
        return y.view(x.shape), aux

    def _expert_loop(self, flat: Tensor, top_p: Tensor, top_e: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
        """Each expert on its assignments (``index_select``, MLP, ``index_add``); the loads are read on the host.

        Returns ``(y, routed)``: the output and the assignments per expert before capacity.
        """
        k = self.top_k
        with torch.no_grad():
            routed = _count(top_e, self.n_experts)
            order, kept = self._plan(top_p, top_e, routed, self.capacity(flat.shape[0]))
        y = torch.zeros_like(flat)
        start = 0
        for expert, count in zip(self.experts, kept, strict=True):
            if count:
                assignments = order[start : start + count]
                tokens = assignments // k
                out = expert(flat.index_select(0, tokens))
                y.index_add_(0, tokens, (out * gates[assignments, None]).to(y.dtype))
            start += count
        self._record(kept, flat.shape[0] * k)
        return y, routed

    def _grouped_experts(
        self, flat: Tensor, top_p: Tensor, top_e: Tensor, gates: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | int]:
        """All experts as two grouped GEMMs over device offsets: no host read. Returns ``(y, routed, real tokens)``."""
        k = self.top_k
        with torch.no_grad():
            real: Tensor | int = flat.shape[0]
            if mask is not None:
                # Padding rows: after every real assignment in priority, routed to no expert's count.
                row = mask.repeat_interleave(k) if k > 1 else mask
                top_p = torch.where(row, top_p, -1.0)
                real = mask.sum().clamp(min=1)
            routed = _count(top_e, self.n_experts, None if mask is None else row)
            order, kept = self._plan_on_device(top_p, top_e, routed, real, None if mask is None else row)
            align = group_alignment(flat.device, gemm_dtype(flat))
            rows, keep, offsets = padded_groups(kept, len(order), align)
            assignment = order[rows]
        tokens = assignment // k
        bias_of = top_e[assignment]
        h = grouped_linear(flat.index_select(0, tokens), [e.fc for e in self.experts], bias_of, offsets, keep)
        h = F.gelu(h)
        out = grouped_linear(h, [e.proj for e in self.experts], bias_of, offsets, keep)
        out = self.experts[0].drop(out)  # every expert's dropout is the same module type and rate
        y = torch.zeros_like(flat).index_add_(0, tokens, (out * gates[assignment, None]).to(flat.dtype))
        self._record(kept, (real if isinstance(real, int) else real.detach()) * k)
        return y, routed, real

    def _plan_on_device(
        self, top_p: Tensor, top_e: Tensor, routed: Tensor, real: Tensor | int, row: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Every assignment, the kept ones first grouped by expert; how many are kept per expert.

        The same choice as :meth:`_plan` (priority by probability, ties to the earlier assignment), with the
        capacity and the loads as device tensors.
        """
        by_prob = top_p.argsort(descending=True, stable=True)
        by_priority = by_prob[top_e[by_prob].argsort(stable=True)]
        every = routed if row is None else _count(top_e, self.n_experts)  # padding rows sit in the groups too
        starts = every.cumsum(0) - every
        rank = torch.empty_like(by_priority)
        rank[by_priority] = torch.arange(len(by_priority), device=top_e.device) - starts[top_e[by_priority]]
        order = top_e.argsort(stable=True)
        dropped = torch.zeros_like(order, dtype=torch.bool) if row is None else ~row[order]
        if self.capacity_factor is not None:
            if isinstance(real, int):
                capacity: Tensor | int | None = self.capacity(real)
            else:  # as capacity() does, on the device: the number of real tokens stays there
                capacity = torch.ceil(self.capacity_factor * real * self.top_k / self.n_experts)
            dropped = dropped | (rank[order] >= capacity)
        kept_first = dropped.to(torch.int8).argsort(stable=True)
        order, keep = order[kept_first], ~dropped[kept_first]
        return order, _count(top_e[order], self.n_experts, keep)

    def _plan(self, top_p: Tensor, top_e: Tensor, routed: Tensor, capacity: int | None) -> tuple[Tensor, list[int]]:
        """Which token assignments each expert computes (the per-expert way: its loads read on the host).

        Args:
            top_p: router probability of every assignment, token-major ``(N * top_k,)``.
            top_e: expert of every assignment, same layout.
            routed: assignments per expert before capacity.
            capacity: most assignments per expert, ``None`` for no limit.

        Returns:
            The kept assignment indices grouped by expert (token order within an expert) and the number kept per
            expert.

        """
        # Grouped by expert with token order inside each group: gathers read the tokens in memory order.
        order = top_e.argsort(stable=True)
        # The layer's one host read: each expert's load sizes its matmuls, which is what makes the cost follow the
        # routing (a grouped GEMM over device-side offsets would avoid it).
        loads = routed.tolist()
        if capacity is None or capacity >= max(loads):
            return order, loads
        # Priority within an expert: higher probability first, ties to the earlier assignment (stable sorts).
        by_prob = top_p.argsort(descending=True, stable=True)
        by_priority = by_prob[top_e[by_prob].argsort(stable=True)]
        starts = routed.cumsum(0) - routed
        rank = torch.empty_like(by_priority)
        rank[by_priority] = torch.arange(len(by_priority), device=top_e.device) - starts[top_e[by_priority]]
        # Keep each expert's first ``capacity`` by priority; the kept count is known on the host, so no boolean
        # mask (a read of its size) is needed: sort the kept assignments first within the order and cut.
        kept = [min(n, capacity) for n in loads]
        dropped = rank[order] >= capacity
        order = order[dropped.to(torch.int8).argsort(stable=True)[: sum(kept)]]
        return order, kept

    def _record(self, kept: Tensor | list[int], assignments: Tensor | int) -> None:
        # Shape-probing passes are not real steps: they must not overwrite what a logger reads.
        if not is_probing():
            self._kept, self._assignments = kept, assignments

    def extra_repr(self) -> str:
        """Settings shown in the module's repr."""
        return f"n_experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}"


def _count(experts: Tensor, n_experts: int, where: Tensor | None = None) -> Tensor:
    """Assignments per expert (of those ``where`` is true), on the device."""
    # Not bincount: on CUDA it reads the largest index back to size its output.
    counts = torch.zeros(n_experts, dtype=torch.long, device=experts.device)
    ones = torch.ones_like(experts) if where is None else where.to(experts.dtype)
    return counts.scatter_add_(0, experts, ones)


def _regroup_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    # A load_state_dict post-hook (module level, so that the layer still pickles).
    assert isinstance(module, MoEMLP)
    module._group_experts()
