"""Lightning callbacks: the balancer, the dynamic techniques, and the run summary."""

from dynmo_lightning.callbacks.balancer import DynMoBalancer
from dynmo_lightning.callbacks.freezing import LayerFreezing
from dynmo_lightning.callbacks.pruning import GradualPruning
from dynmo_lightning.callbacks.summary import RunSummary

__all__ = ["DynMoBalancer", "GradualPruning", "LayerFreezing", "RunSummary"]
