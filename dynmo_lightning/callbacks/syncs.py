"""HostSyncCounter: how often a training step reads a tensor's value on the host (a stall of the GPU stream).

A host read (``Tensor.item``, ``tolist``, ``bool(t)``, ``int(t)``, ``float(t)``) waits until the device has computed the
value: cheap on CPU, a pipeline bubble on a GPU. The counter wraps those methods of ``torch.Tensor`` while a run is
inside :meth:`HostSyncCounter.patched` and counts the calls of each training step, from one ``on_train_batch_start`` to
the next (so the end-of-step hooks of callbacks and of the LightningModule count too), on every device. On CUDA it also
counts what ``torch.cuda.set_sync_debug_mode("warn")`` reports outside those methods (synchronising kernels, e.g. a
boolean-mask gather): a read method's own synchronisation, which the debug mode reports too, counts once.

Beside it, a ``TorchDispatchMode`` sees what those methods miss, at the level of aten operators: data-dependent
reads (``aten._local_scalar_dense``, ``aten.nonzero``, ``aten.masked_select``, ``aten.equal``, indexing with a
boolean mask, ...: a device must finish to know a value or a shape) and tensors made from Python data
(``aten.lift_fresh``: ``torch.tensor(list, device=...)`` is a pageable host-to-device copy). It counts them per step
(:attr:`HostSyncCounter.dispatch_counts`) with the call site of each (:attr:`HostSyncCounter.dispatch_sites`): the
first frame outside torch. Lightning's own (its progress-bar and logging values) and the optimizer's are kept out of
the count and shown in the sites.

The dynamics' documented counts are checked with it in ``tests/callbacks/test_host_syncs.py``; README's GPU section
lists them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from dynmo_lightning.core.context import is_on_host

#: The ``torch.Tensor`` methods that read a value on the host.
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")

#: aten operators whose result needs the device's values on the host: a number, a data-dependent shape, a bool.
DATA_DEPENDENT_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten.equal",
        "aten.is_nonzero",
        "aten.unique_dim",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.repeat_interleave",
    }
)

#: aten operators that turn Python data into a tensor (on an accelerator: a pageable host-to-device copy).
HOST_DATA_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy"})

#: Operators that are data-dependent only when indexing with a boolean (or uint8) mask.
_MASK_INDEX_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})

# Frames of these packages are not the call site: the first frame outside them is.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LIGHTNING_DIR = os.path.dirname(os.path.dirname(pl.__file__)) + os.sep


def classify(op: str, args: tuple[Any, ...]) -> str | None:
    """``"read"`` for a data-dependent operator call, ``"host_data"`` for a tensor made from Python data, else None.

    Args:
        op: the operator's packet name (``"aten.index"``, overload stripped).
        args: its positional arguments (the indices of an ``index`` call decide).
    """
    if op in HOST_DATA_OPS:
        return "host_data"
    if op in DATA_DEPENDENT_OPS:
        return "read"
    if op in _MASK_INDEX_OPS and len(args) > 1 and isinstance(args[1], (list, tuple)):
        masks = (torch.bool, torch.uint8)
        if any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1]):
            return "read"
    return None


def _internal(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename == __file__


def _call_site() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _syncs(warned: list[warnings.WarningMessage]) -> int:
    """How many of ``warned`` are CUDA's sync debug mode reporting a synchronisation."""
    return sum("synchroniz" in str(w.message) for w in warned)


class _DispatchCounter(TorchDispatchMode):
    """Calls ``record(kind, op, site)`` for every data-dependent or host-data operator, then runs it."""

    def __init__(self, record: Callable[[str, str, str], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        op = f"aten.{func._opname}" if func.namespace == "aten" else str(func)
        kind = classify(op, args)
        if kind is not None:
            self._record(kind, op, _call_site())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_dispatch() -> Iterator[collections.Counter[str]]:
    """Count the data-dependent operators and host-data tensors run inside, as ``"kind op @ file:line" -> calls``."""
    seen: collections.Counter[str] = collections.Counter()
    with _DispatchCounter(lambda kind, op, site: seen.update([f"{kind} {op} @ {site}"])):
        yield seen


class HostSyncCounter(Callback):
    """Counts host reads of tensor values per training step (run the fit inside :meth:`patched`).

    Args:
        cuda: also count the synchronisations CUDA's sync debug mode reports.
        dispatch: also count data-dependent operators and tensors made from Python data (a ``TorchDispatchMode``
            inside :meth:`patched`; it slows every operator down a little).

    Attributes:
        counts: reads per step, the optimizer step included (on CUDA with the debug mode's other synchronisations).
        optimizer_counts: of those, the reads inside ``optimizer.step()`` but outside its closure (Adam reads each
            parameter's step count, a CPU tensor unless ``capturable`` or ``fused``: not a device synchronisation).
        dispatch_counts: per step, the data-dependent operators and host-data tensors the dispatch mode saw outside
            the read methods above, Lightning's own (its logging) and the optimizer step's left out.
        own_counts: per step, everything of ours that waits for the device or copies from the host, each once: the
            read methods' calls and the dispatch mode's operators, Lightning's and the optimizer's left out.
        dispatch_sites: per step, ``"kind name @ file:line" -> calls`` of every read and operator counted (``kind``:
            ``method``, ``read`` or ``host_data``), Lightning's and the optimizer's marked ``[lightning]`` and
            ``[optimizer]``, host-only work on CPU groups (``protocol.on_host``) ``[host]``.
    """

    def __init__(self, cuda: bool = False, dispatch: bool = True) -> None:
        self.cuda = cuda
        self.dispatch = dispatch
        self.counts: list[int] = []
        self.optimizer_counts: list[int] = []
        self.dispatch_counts: list[int] = []
        self.own_counts: list[int] = []
        self.dispatch_sites: list[dict[str, int]] = []
        self._sites: collections.Counter[str] = collections.Counter()
        self._n_dispatch = self._n_own = 0
        self._in_method = False  # inside a read method: its own operators are that one read
        self._n = 0
        self._active = False
        self._n_optimizer = 0
        self._in_optimizer = False
        self._caught: Any = None
        self._warned: list[warnings.WarningMessage] = []
        self._n_method_syncs = 0  # synchronisations CUDA reported inside counted read methods

    @contextlib.contextmanager
    def patched(self) -> Iterator[HostSyncCounter]:
        """Wrap the host-read methods of ``torch.Tensor`` for the duration of a run."""
        originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

        def wrap(name: str, fn: Any) -> Any:
            def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not self._active or self._in_method:
                    return fn(t, *args, **kwargs)
                self._n += 1
                self._n_optimizer += self._in_optimizer
                self._record("method", f"Tensor.{name.strip('_')}", _call_site())
                self._in_method = True
                warned = len(self._warned)
                try:
                    return fn(t, *args, **kwargs)
                finally:
                    self._in_method = False
                    # CUDA's warning about this very read is the same sync, already counted as the call.
                    self._n_method_syncs += _syncs(self._warned[warned:])

            return counted

        hooks = [register_optimizer_step_pre_hook(self._entering), register_optimizer_step_post_hook(self._leaving)]
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        mode = _DispatchCounter(self._record) if self.dispatch else contextlib.nullcontext()
        try:
            with mode:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for hook in hooks:
                hook.remove()

    def _record(self, kind: str, op: str, site: str) -> None:
        if not self._active or self._in_method:
            return
        if self._in_optimizer:
            owner = "[optimizer] "
        elif is_on_host():
            owner = "[host] "  # host data on a CPU group: no device involved (protocol.on_host)
        else:
            owner = "[lightning] " if site.startswith(_LIGHTNING_DIR) else ""
        self._sites[f"{owner}{kind} {op} @ {site}"] += 1
        self._n_own += not owner
        self._n_dispatch += not owner and kind != "method"

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
        self._n, self._n_optimizer, self._n_dispatch, self._n_own, self._active = 0, 0, 0, 0, True
        self._n_method_syncs = 0
        self._sites = collections.Counter()
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

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed fit must not leave CUDA's sync debug mode on and every later warning recorded away.
        self._close()

    def _close(self) -> None:
        """End the step being counted (if any) and record its counts."""
        if not self._active:
            return
        self._active = False
        n = self._n
        self.optimizer_counts.append(self._n_optimizer)
        self.dispatch_counts.append(self._n_dispatch)
        self.own_counts.append(self._n_own)
        self.dispatch_sites.append(dict(self._sites))
        if self.cuda and self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            n += _syncs(self._warned) - self._n_method_syncs
            self._caught.__exit__(None, None, None)
            self._caught = None
        self.counts.append(n)
