"""DynamicSparseAttention: block-sparse causal attention whose per-layer density adapts during training.

Builds the reference GPT with :class:`~dynmo_lightning.models.sparse_attention.SparseCausalSelfAttention`
(``GPT(attention="sparse", ..)``): each query block keeps its diagonal block and the top-scoring earlier key blocks
(pooled q·k), and each layer moves its density toward ``target_coverage`` (the share of attention mass the kept
blocks capture). Layers settle at different densities and keep drifting, so attention cost differs across layers and
over time; only kept blocks are computed. Density 1 is exactly dense attention. Logged every ``log_every_n_steps``
per layer: ``sparse_attention/layer{i}/density`` and ``sparse_attention/layer{i}/coverage``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, RoutedSettings, check_at_least, check_fractions
from dynmo_lightning.core.host_values import host_value
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention
from dynmo_lightning.settings import configured_by


@dataclasses.dataclass(kw_only=True)
class SparseAttentionSettings(RoutedSettings):
    """:class:`DynamicSparseAttention`'s settings (Hydra: ``conf/dynamics/sparse_attention.yaml``)."""

    attn_block: int = 16
    """Attention block size along the sequence (must divide the sequence length)."""
    density: float = 1.0
    """Starting density in (0, 1] (1: dense; the adaptation takes it from there)."""
    target_coverage: float = 0.9
    """Attention-mass coverage each layer's density is steered to, in (0, 1]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(1, attn_block=self.attn_block)
        check_fractions(density=self.density, target_coverage=self.target_coverage)


class DynamicSparseAttention(
    RoutedDynamics, name="sparse_attention", part=SparseCausalSelfAttention, settings=SparseAttentionSettings
):
    """Dynamic block-sparse attention; set by :class:`SparseAttentionSettings` (its fields, or one object)."""

    settings: SparseAttentionSettings
    options: ClassVar[dict[str, str]] = {
        "attn_block": "attn_block",
        "attn_density": "density",
        "attn_target_coverage": "target_coverage",
    }
    fixed_options: ClassVar[dict[str, Any]] = {"attention": "sparse"}

    @configured_by(SparseAttentionSettings)
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

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
