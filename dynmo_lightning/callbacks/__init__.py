"""Lightning callbacks: the balancer and the run summary."""

from dynmo_lightning.callbacks.balancer import DynMoBalancer
from dynmo_lightning.callbacks.summary import RunSummary

__all__ = ["DynMoBalancer", "RunSummary"]
