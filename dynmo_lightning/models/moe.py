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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dynmo_lightning.models.blocks import MLP
from dynmo_lightning.protocol import is_probing


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

    #: Its output for a token depends on the other tokens of the call (capacity): callers pass only real tokens.
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
        # Plain attributes (not buffers): logging statistics that travel with the pickled module, not checkpointed.
        self.tokens_per_expert: list[int] = [0] * n_experts
        self.drop_fraction = 0.0

    def capacity(self, n_tokens: int) -> int | None:
        """Most assignments one expert takes from a call with ``n_tokens`` tokens (``None``: unlimited)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Route tokens to their experts.

        Args:
            x: tokens ``(N, C)`` (e.g. only the tokens a caller selected) or hidden states ``(B, T, C)``.

        Returns:
            ``(y, aux)``: ``y`` has the shape of ``x`` (zero where every assignment of a token was dropped) and ``aux``
            is the scalar ``aux_loss_coef * E * sum_e f_e * P_e + z_loss_coef * mean(logsumexp(logits) ** 2)``, with
            ``f_e`` the fraction of token assignments routed to expert ``e`` (before capacity) and ``P_e`` the mean
            router probability of ``e``. ``aux`` is differentiable with respect to the router.

        """
        flat = x.reshape(-1, x.shape[-1])
        n, k, n_exp = flat.shape[0], self.top_k, self.n_experts
        logits = self.router(flat).float()
        y = torch.zeros_like(flat)
        if n == 0:
            self._record([0] * n_exp, 0.0)
            # Keep the router in the graph so that callers can always backpropagate through ``aux``.
            return y.view(x.shape), logits.sum() * 0.0
        probs = logits.softmax(-1)
        top_p, top_e = probs.topk(k, dim=-1)
        gates = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)

        with torch.no_grad():
            order, kept, routed = self._plan(top_p.reshape(-1), top_e.reshape(-1), self.capacity(n))
        gates = gates.reshape(-1)
        start = 0
        for expert, count in zip(self.experts, kept, strict=True):
            if count:
                assignments = order[start : start + count]
                tokens = assignments // k
                out = expert(flat.index_select(0, tokens))
                y.index_add_(0, tokens, (out * gates[assignments, None]).to(y.dtype))
            start += count

        fraction = routed.float() / (n * k)
        balance = n_exp * (fraction * probs.mean(0)).sum()
        z_loss = torch.logsumexp(logits, -1).square().mean()
        aux = self.aux_loss_coef * balance + self.z_loss_coef * z_loss
        self._record(kept, 1.0 - sum(kept) / (n * k))
        return y.view(x.shape), aux

    def _plan(self, top_p: Tensor, top_e: Tensor, capacity: int | None) -> tuple[Tensor, list[int], Tensor]:
        """Which token assignments each expert computes.

        Args:
            top_p: router probability of every assignment, token-major ``(N * top_k,)``.
            top_e: expert of every assignment, same layout.
            capacity: most assignments per expert, ``None`` for no limit.

        Returns:
            The kept assignment indices grouped by expert (token order within an expert), the number kept per expert,
            and the number routed per expert before capacity.

        """
        # Not bincount: on CUDA it reads the largest index back to size its output.
        routed = torch.zeros(self.n_experts, dtype=torch.long, device=top_e.device)
        routed.scatter_add_(0, top_e, torch.ones_like(top_e))
        # Grouped by expert with token order inside each group: gathers read the tokens in memory order.
        order = top_e.argsort(stable=True)
        # The layer's one host read: each expert's load sizes its matmuls, which is what makes the cost follow the
        # routing (a grouped GEMM over device-side offsets would avoid it).
        loads = routed.tolist()
        if capacity is None or capacity >= max(loads):
            return order, loads, routed
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
        return order, kept, routed

    def _record(self, kept: list[int], drop_fraction: float) -> None:
        # Shape-probing passes are not real steps: they must not overwrite what a logger reads.
        if not is_probing():
            self.tokens_per_expert = kept
            self.drop_fraction = drop_fraction

    def extra_repr(self) -> str:
        """Settings shown in the module's repr."""
        return f"n_experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}"
