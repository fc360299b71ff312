"""DynamicSparseAttention: block-sparse causal attention whose per-layer density adapts during training.

Builds the reference GPT with :class:`~dynmo_lightning.models.sparse_attention.SparseCausalSelfAttention`
(``GPT(attention="sparse", ..)``): each query block keeps its diagonal block and the top-scoring earlier key blocks
(pooled q·k), and each layer moves its density toward ``target_coverage`` (the share of attention mass the kept
blocks capture). Layers settle at different densities and keep drifting, so attention cost differs across layers and
over time; only kept blocks are computed. Density 1 is exactly dense attention. Logged every ``log_every_n_steps``
per layer: ``dynamics/attn_density_layer{i}`` and ``dynamics/attn_coverage_layer{i}``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import enable, gather, parts
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention
from dynmo_lightning.protocol import host_value


class DynamicSparseAttention(Callback):
    """Dynamic block-sparse attention.

    Args:
        attn_block: attention block size along the sequence (must divide the sequence length).
        density: starting density in (0, 1] (1: dense; the adaptation takes it from there).
        target_coverage: attention-mass coverage each layer's density is steered to, in (0, 1].
        log_every_n_steps: logging interval.
    """

    def __init__(
        self, attn_block: int = 16, density: float = 1.0, target_coverage: float = 0.9, log_every_n_steps: int = 10
    ) -> None:
        if attn_block < 1:
            raise ValueError(f"dynamics.attn_block={attn_block} must be >= 1")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"dynamics.density={density} must be in (0, 1]")
        if not 0.0 < target_coverage <= 1.0:
            raise ValueError(f"dynamics.target_coverage={target_coverage} must be in (0, 1]")
        self.options = {
            "attention": "sparse",
            "attn_block": attn_block,
            "attn_density": density,
            "attn_target_coverage": target_coverage,
        }
        self.log_every_n_steps = max(1, log_every_n_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        enable(pl_module, SparseCausalSelfAttention, "sparse attention (GPT(attention='sparse'))", **self.options)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps:
            return
        local = {i: (host_value(m, "density"), m.last_coverage) for i, m in parts(pl_module, SparseCausalSelfAttention)}
        metrics = {}
        for i, (density, coverage) in sorted(gather(local, trainer).items()):
            metrics[f"dynamics/attn_density_layer{i}"] = density
            if not math.isnan(coverage):
                metrics[f"dynamics/attn_coverage_layer{i}"] = coverage
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
