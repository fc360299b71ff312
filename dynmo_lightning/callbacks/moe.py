"""MixtureOfExperts: MoE MLPs in every ``every``-th block of the reference GPT, with routing statistics logged.

Builds the model with :class:`~dynmo_lightning.models.moe.MoEMLP` blocks (``GPT(n_experts=.., moe_every=..)``):
experts compute only on the tokens routed to them, so a block's cost follows its routing — hot experts, dropped
tokens and capacity changes move per-layer cost, which the balancer then follows. The auxiliary load-balancing and
router z-losses travel with the activations (the carried ``aux``), so routers on early pipeline stages get their
gradients. Logged every ``log_every_n_steps`` per MoE layer: ``dynamics/moe_drop_frac_layer{i}`` and
``dynamics/moe_max_load_layer{i}`` (the busiest expert's share of the tokens; ``1/n_experts`` is perfect balance).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import enable, gather, parts
from dynmo_lightning.models.moe import MoEMLP


class MixtureOfExperts(Callback):
    """Mixture-of-Experts MLPs.

    Args:
        n_experts: experts per MoE layer (>= 2).
        every: every ``every``-th block gets an MoE MLP.
        top_k: experts per token (1 = Switch, 2 = GShard).
        capacity_factor: expert capacity factor (> 0), or ``None`` for dropless routing.
        aux_loss_coef: weight of the load-balancing loss.
        z_loss_coef: weight of the router z-loss.
        log_every_n_steps: logging interval.
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
        if every < 1:
            raise ValueError(f"dynamics.every={every} must be >= 1")
        self.options = {
            "n_experts": n_experts,
            "moe_every": every,
            "moe_top_k": top_k,
            "moe_capacity_factor": capacity_factor,
            "moe_aux_coef": aux_loss_coef,
            "moe_z_coef": z_loss_coef,
        }
        self.log_every_n_steps = max(1, log_every_n_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        enable(pl_module, MoEMLP, "MoE MLPs (GPT(n_experts=4))", **self.options)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps:
            return
        local = {i: (list(m.tokens_per_expert), m.drop_fraction) for i, m in parts(pl_module, MoEMLP)}
        metrics = {}
        for i, (tokens, dropped) in sorted(gather(local, trainer).items()):
            metrics[f"dynamics/moe_drop_frac_layer{i}"] = float(dropped)
            if sum(tokens):
                metrics[f"dynamics/moe_max_load_layer{i}"] = max(tokens) / sum(tokens)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
