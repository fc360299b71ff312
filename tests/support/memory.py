"""Peak bytes of the tensors ops make, counted on any device (a CPU test of what a GPU would hold)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    """Within: the bytes of the storages made by ops and still alive (:attr:`live`), and their peak (:attr:`peak`).

    Storages made before the mode (parameters, a schedule's buffers built earlier) are not counted, nor views.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            # A view or an in-place result is an input's storage: only new storages are counted.
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and _key(t) not in inputs:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._alive:
                    self._alive[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
