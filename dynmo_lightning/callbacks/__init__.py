"""Lightning callbacks: the balancer, the dynamics (each set by its settings class), the run and model summaries."""

from dynmo_lightning.callbacks.balancer import BalancerSettings, DynMoBalancer
from dynmo_lightning.callbacks.early_exit import EarlyExitSettings, TokenEarlyExit
from dynmo_lightning.callbacks.freezing import FreezingSettings, LayerFreezing
from dynmo_lightning.callbacks.mod import MixtureOfDepths, MoDSettings
from dynmo_lightning.callbacks.model_summary import (
    PipelineModelSummary,
    PipelineRichModelSummary,
    PipelineSummary,
    pipeline_summary,
    use_pipeline_summaries,
)
from dynmo_lightning.callbacks.moe import MixtureOfExperts, MoESettings
from dynmo_lightning.callbacks.pruning import GradualPruning, PruningSettings
from dynmo_lightning.callbacks.sparse_attention import DynamicSparseAttention, SparseAttentionSettings
from dynmo_lightning.callbacks.summary import RunSummary
from dynmo_lightning.callbacks.syncs import HostSyncCounter
from dynmo_lightning.callbacks.trace import CostTrace

__all__ = [
    "BalancerSettings",
    "CostTrace",
    "DynMoBalancer",
    "DynamicSparseAttention",
    "EarlyExitSettings",
    "FreezingSettings",
    "GradualPruning",
    "HostSyncCounter",
    "LayerFreezing",
    "MixtureOfDepths",
    "MixtureOfExperts",
    "MoDSettings",
    "MoESettings",
    "PipelineModelSummary",
    "PipelineRichModelSummary",
    "PipelineSummary",
    "PruningSettings",
    "RunSummary",
    "SparseAttentionSettings",
    "TokenEarlyExit",
    "pipeline_summary",
    "use_pipeline_summaries",
]
