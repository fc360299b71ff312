"""DynamicSparseAttention: block-sparse causal attention whose per-layer density adapts during training.

Builds the reference GPT with :class:`~dynmo_lightning.models.sparse_attention.SparseCausalSelfAttention`
(``GPT(attention="sparse", ..)``): each query block keeps its diagonal block and the top-scoring earlier key blocks
(pooled q·k), and each layer moves its density toward ``target_coverage`` (the share of attention mass the kept
blocks capture). Layers settle at different densities and keep drifting, so attention cost differs across layers and
over time; only kept blocks are computed. Density 1 is exactly dense attention. Logged every ``log_every_n_steps``
per layer: ``sparse_attention/layer{i}/density`` and ``sparse_attention/layer{i}/coverage``.
"""

from __future__ import annotations

import math

from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, check_at_least, check_fractions
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention
from dynmo_lightning.protocol import host_value


class DynamicSparseAttention(
    RoutedDynamics,
    name="sparse_attention",
    part=SparseCausalSelfAttention,
    setting="sparse attention (GPT(attention='sparse'))",
):
    """Dynamic block-sparse attention.

    Args:
        attn_block: attention block size along the sequence (must divide the sequence length).
        density: starting density in (0, 1] (1: dense; the adaptation takes it from there).
        target_coverage: attention-mass coverage each layer's density is steered to, in (0, 1].
        log_every_n_steps: steps between logs of the densities and coverages.
    """

    def __init__(
        self, attn_block: int = 16, density: float = 1.0, target_coverage: float = 0.9, log_every_n_steps: int = 10
    ) -> None:
        check_at_least(1, attn_block=attn_block)
        check_fractions(density=density, target_coverage=target_coverage)
        super().__init__(
            log_every_n_steps,
            attention="sparse",
            attn_block=attn_block,
            attn_density=density,
            attn_target_coverage=target_coverage,
        )

    @override
    def layer_stats(self, local: list[tuple[int, SparseCausalSelfAttention]]) -> dict[int, tuple[float, float]]:
        return {i: (host_value(m, "density"), m.last_coverage) for i, m in local}

    @override
    def layer_metrics(self, stats: dict[int, tuple[float, float]]) -> dict[int, dict[str, float]]:
        metrics: dict[int, dict[str, float]] = {}
        for i, (density, coverage) in stats.items():
            metrics[i] = {"density": density}
            if not math.isnan(coverage):
                metrics[i]["coverage"] = coverage
        return metrics
