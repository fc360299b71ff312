"""HostSyncCounter: how often a training step reads a tensor's value on the host (a stall of the GPU stream).

A host read (``Tensor.item``, ``tolist``, ``bool(t)``, ``int(t)``, ``float(t)``) waits until the device has computed the
value: cheap on CPU, a pipeline bubble on a GPU. The counter wraps those methods of ``torch.Tensor`` while a run is
inside :meth:`HostSyncCounter.patched` and counts the calls of each training step, from one ``on_train_batch_start`` to
the next (so the end-of-step hooks of callbacks and of the LightningModule count too), on every device. On CUDA it also
counts what ``torch.cuda.set_sync_debug_mode("warn")`` reports (synchronising kernels, e.g. a boolean-mask gather).

The dynamics' documented counts are checked with it in ``tests/callbacks/test_host_syncs.py``; README's GPU section
lists them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from typing_extensions import override

#: The ``torch.Tensor`` methods that read a value on the host.
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")


class HostSyncCounter(Callback):
    """Counts host reads of tensor values per training step (run the fit inside :meth:`patched`).

    Args:
        cuda: also count the synchronisations CUDA's sync debug mode reports.

    Attributes:
        counts: reads per step, the optimizer step included.
        optimizer_counts: of those, the reads inside ``optimizer.step()`` but outside its closure (Adam reads each
            parameter's step count, a CPU tensor unless ``capturable`` or ``fused``: not a device synchronisation).
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.counts: list[int] = []
        self.optimizer_counts: list[int] = []
        self._n = 0
        self._active = False
        self._n_optimizer = 0
        self._in_optimizer = False
        self._caught: Any = None
        self._warned: list[warnings.WarningMessage] = []

    @contextlib.contextmanager
    def patched(self) -> Iterator[HostSyncCounter]:
        """Wrap the host-read methods of ``torch.Tensor`` for the duration of a run."""
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

        def wrap(fn: Any) -> Any:
            def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if self._active:
                    self._n += 1
                    self._n_optimizer += self._in_optimizer
                return fn(t, *args, **kwargs)

            return counted

        hooks = [register_optimizer_step_pre_hook(self._entering), register_optimizer_step_post_hook(self._leaving)]
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for hook in hooks:
                hook.remove()

    def _entering(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Optimizer step pre-hook: count as the optimizer's, except the closure (Lightning runs the step in it)."""
        self._in_optimizer = True
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None:
            return None

        def outside() -> Any:
            self._in_optimizer = False
            try:
                return closure()
            finally:
                self._in_optimizer = True

        if "closure" in kwargs:
            return args, {**kwargs, "closure": outside}
        return (outside, *args[1:]), kwargs

    def _leaving(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_optimizer = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._close()
        self._n, self._n_optimizer, self._active = 0, 0, True
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
            self._caught = warnings.catch_warnings(record=True)
            self._warned = self._caught.__enter__()
            warnings.simplefilter("always")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def _close(self) -> None:
        """End the step being counted (if any) and record its counts."""
        if not self._active:
            return
        self._active = False
        n = self._n
        self.optimizer_counts.append(self._n_optimizer)
        if self.cuda and self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            n += sum("synchroniz" in str(w.message) for w in self._warned)
            self._caught.__exit__(None, None, None)
            self._caught = None
        self.counts.append(n)
