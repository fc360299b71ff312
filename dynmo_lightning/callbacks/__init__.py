"""Lightning callbacks: run summary (and, with the balancing and dynamics features, the balancer and dynamics)."""

from dynmo_lightning.callbacks.summary import RunSummary

__all__ = ["RunSummary"]
