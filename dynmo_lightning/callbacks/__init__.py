"""Lightning callbacks: the balancer, the dynamic techniques, and the run summary (each set by its settings class)."""

from dynmo_lightning.callbacks.balancer import BalancerSettings, DynMoBalancer
from dynmo_lightning.callbacks.early_exit import EarlyExitSettings, TokenEarlyExit
from dynmo_lightning.callbacks.freezing import FreezingSettings, LayerFreezing
from dynmo_lightning.callbacks.mod import MixtureOfDepths, MoDSettings
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
    "PruningSettings",
    "RunSummary",
    "SparseAttentionSettings",
    "TokenEarlyExit",
]
