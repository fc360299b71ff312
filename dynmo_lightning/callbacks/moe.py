"""MixtureOfExperts: MoE MLPs in every ``every``-th block of the reference GPT, with routing statistics logged.

Builds the model with :class:`~dynmo_lightning.models.moe.MoEMLP` blocks (``GPT(n_experts=.., moe_every=..)``):
experts compute only on the tokens routed to them, so a block's cost follows its routing — hot experts, dropped
tokens and capacity changes move per-layer cost, which the balancer then follows. The auxiliary load-balancing and
router z-losses travel with the activations (the carried ``aux``), so routers on early pipeline stages get their
gradients. Logged every ``log_every_n_steps`` per MoE layer: ``moe/layer{i}/drop_frac`` and ``moe/layer{i}/max_load``
(the busiest expert's share of the tokens; ``1/n_experts`` is perfect balance).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, RoutedSettings, check_at_least
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.settings import configured_by


@dataclasses.dataclass(kw_only=True)
class MoESettings(RoutedSettings):
    """:class:`MixtureOfExperts`' settings (Hydra: ``conf/dynamics/moe.yaml``)."""

    n_experts: int = 4
    """Experts per MoE layer (at least 2: one expert is a dense MLP)."""
    every: int = 2
    """Every ``every``-th block gets an MoE MLP."""
    top_k: int = 1
    """Experts per token (1: Switch, 2: GShard), at most ``n_experts``."""
    capacity_factor: float | None = 1.25
    """Expert capacity over the even share of the tokens (> 0), or ``None`` for dropless routing."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss."""
    z_loss_coef: float = 1e-3
    """Weight of the router z-loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 2:
            raise ValueError(f"dynamics.n_experts={self.n_experts} must be >= 2 (one expert is a dense MLP)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"dynamics.top_k={self.top_k} must be between 1 and dynamics.n_experts={self.n_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"dynamics.capacity_factor={self.capacity_factor} must be > 0 (or null: dropless)")
        check_at_least(1, every=self.every)


class MixtureOfExperts(RoutedDynamics, name="moe", part=MoEMLP, settings=MoESettings):
    """Mixture-of-Experts MLPs; set by :class:`MoESettings` (its fields as keywords, or one object)."""

    settings: MoESettings
    options: ClassVar[dict[str, str]] = {
        "n_experts": "n_experts",
        "moe_every": "every",
        "moe_top_k": "top_k",
        "moe_capacity_factor": "capacity_factor",
        "moe_aux_coef": "aux_loss_coef",
        "moe_z_coef": "z_loss_coef",
    }

    @configured_by(MoESettings)
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

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
