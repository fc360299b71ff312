"""MixtureOfExperts: MoE MLPs in every ``every``-th block of the reference GPT, with routing statistics logged.

Builds the model with :class:`~dynmo_lightning.models.moe.MoEMLP` blocks (``GPT(n_experts=.., moe_every=..)``):
experts compute only on the tokens routed to them, so a block's cost follows its routing — hot experts, dropped
tokens and capacity changes move per-layer cost, which the balancer then follows. The auxiliary load-balancing and
router z-losses travel with the activations (the carried ``aux``), so routers on early pipeline stages get their
gradients. Logged every ``log_every_n_steps`` per MoE layer: ``moe/layer{i}/drop_frac`` and ``moe/layer{i}/max_load``
(the busiest expert's share of the tokens; ``1/n_experts`` is perfect balance).
"""

from __future__ import annotations

from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, check_at_least
from dynmo_lightning.models.moe import MoEMLP


class MixtureOfExperts(RoutedDynamics, name="moe", part=MoEMLP, setting="MoE MLPs (GPT(n_experts=4))"):
    """Mixture-of-Experts MLPs.

    Args:
        n_experts: experts per MoE layer (>= 2).
        every: every ``every``-th block gets an MoE MLP.
        top_k: experts per token (1 = Switch, 2 = GShard).
        capacity_factor: expert capacity factor (> 0), or ``None`` for dropless routing.
        aux_loss_coef: weight of the load-balancing loss.
        z_loss_coef: weight of the router z-loss.
        log_every_n_steps: steps between logs of the drop rates and expert loads.
    """

    def __init__(
        self,
        n_experts: int = 4,
        every: int = 2,
        top_k: int = 1,
        capacity_factor: float | None = 1.25,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 1e-3,
        log_every_n_steps: int = 10,
    ) -> None:
        if n_experts < 2:
            raise ValueError(f"dynamics.n_experts={n_experts} must be >= 2 (one expert is a dense MLP)")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"dynamics.top_k={top_k} must be between 1 and dynamics.n_experts={n_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"dynamics.capacity_factor={capacity_factor} must be > 0 (or null: dropless)")
        check_at_least(1, every=every)
        super().__init__(
            log_every_n_steps,
            n_experts=n_experts,
            moe_every=every,
            moe_top_k=top_k,
            moe_capacity_factor=capacity_factor,
            moe_aux_coef=aux_loss_coef,
            moe_z_coef=z_loss_coef,
        )

    @override
    def layer_stats(self, local: list[tuple[int, MoEMLP]]) -> dict[int, tuple[list[int], float]]:
        return {i: (list(m.tokens_per_expert), m.drop_fraction) for i, m in local}

    @override
    def layer_metrics(self, stats: dict[int, tuple[list[int], float]]) -> dict[int, dict[str, float]]:
        metrics: dict[int, dict[str, float]] = {}
        for i, (tokens, dropped) in stats.items():
            metrics[i] = {"drop_frac": float(dropped)}
            if sum(tokens):
                metrics[i]["max_load"] = max(tokens) / sum(tokens)
        return metrics
