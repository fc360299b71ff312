"""Peak bytes of the tensors ops make, counted on any device (see :mod:`dynmo_lightning.bench.allocations`)."""

from dynmo_lightning.bench.allocations import PeakBytes, storages

__all__ = ["PeakBytes", "storages"]
