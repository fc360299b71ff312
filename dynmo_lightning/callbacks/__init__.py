"""Lightning callbacks: the balancer, the dynamic techniques, and the run summary."""

from dynmo_lightning.callbacks.balancer import DynMoBalancer
from dynmo_lightning.callbacks.early_exit import TokenEarlyExit
from dynmo_lightning.callbacks.freezing import LayerFreezing
from dynmo_lightning.callbacks.mod import MixtureOfDepths
from dynmo_lightning.callbacks.moe import MixtureOfExperts
from dynmo_lightning.callbacks.pruning import GradualPruning
from dynmo_lightning.callbacks.sparse_attention import DynamicSparseAttention
from dynmo_lightning.callbacks.summary import RunSummary
from dynmo_lightning.callbacks.syncs import HostSyncCounter
from dynmo_lightning.callbacks.trace import CostTrace

__all__ = [
    "CostTrace",
    "DynMoBalancer",
    "DynamicSparseAttention",
    "GradualPruning",
    "HostSyncCounter",
    "LayerFreezing",
    "MixtureOfDepths",
    "MixtureOfExperts",
    "RunSummary",
    "TokenEarlyExit",
]
