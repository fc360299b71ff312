"""What tensors hold, counted on any device (a CPU measure of what a GPU would hold): benchmarks and tests.

A ``TorchDispatchMode`` sees every operation on a tensor subclass such as a DTensor (FSDP2's and tensor parallelism's
parameters) only as the subclass's operation: it is off while the DTensor runs the operation on its local tensor.
So the storages are taken from what the operations return, subclasses unwrapped to the tensors inside them
(``__tensor_flatten__``): a DTensor's local part is counted, which a count of plain tensors alone would miss.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from dynmo_lightning.profiling import release_host_memory


def storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    """The storages holding the tensors of ``tree``: a subclass's inner tensors' (a DTensor's local part), not meta."""
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            yield from _inner(t)


def _inner(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _inner(inner)
    elif t.device.type != "meta" and t.untyped_storage().data_ptr():
        yield t.untyped_storage()


class PeakBytes(TorchDispatchMode):
    """Within: the bytes of the live storages (:attr:`live`) and their peak (:attr:`peak`).

    Counted: the storages made by operations while the mode is on (views and in-place results are their inputs'
    storages, not new ones), and those handed to :meth:`track` (what lived before: parameters, optimizer state), each
    until it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, int] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (made before the mode) as live until they are freed."""
        for storage in storages(list(tensors)):
            self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in storages((args, kwargs))}
        for storage in storages(out):
            if storage.data_ptr() not in inputs:  # a view or an in-place result is its input's memory
                self._add(storage)
        return out


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages holding ``tensors`` (DTensors' local parts; a storage shared by views once)."""
    seen: dict[int, int] = {}
    for storage in storages(list(tensors)):
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class ResidentPeak:
    """The most memory the process held at once within the ``with`` block, above what it held at its start.

    Measured by the kernel: the high-water mark of the process's resident set (``VmHWM``), reset on entry
    (``/proc/self/clear_refs``), less the resident set then. It counts every byte of every thread (collectives'
    buffers freed by their worker threads, FSDP2's storage resizes, DTensors' local parts: what a dispatch mode or
    the profiler's per-thread allocation events miss). glibc is told to serve blocks of 64 KiB and more from their
    own mappings (``mallopt``), so a freed tensor leaves the resident set at once, as on a device, instead of
    staying in the heap for reuse. Linux only; on a GPU use ``torch.cuda.max_memory_allocated``.

    Attributes:
        peak: bytes above the start at the highest point.
        start: the resident bytes at the start.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.start = 0

    def __enter__(self) -> ResidentPeak:
        serve_large_blocks_from_mappings()
        release_host_memory()  # free pages of the heap back: reused, they would hide what the block allocates
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
        self.start = resident_bytes("VmRSS")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = max(0, resident_bytes("VmHWM") - self.start)


def resident_bytes(field: str = "VmRSS") -> int:
    """A size of this process from ``/proc/self/status`` in bytes: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{field} is not in /proc/self/status")


#: glibc's ``mallopt`` parameter for the size from which blocks get mappings of their own.
_M_MMAP_THRESHOLD = -3


def serve_large_blocks_from_mappings(threshold: int = 64 * 1024) -> None:
    """Make glibc serve blocks of ``threshold`` bytes or more from mappings of their own, freed at once.

    By default glibc raises its threshold as large blocks are freed (up to 32 MiB), keeping later ones in its heap:
    resident memory then stays at its peak after a tensor is freed. Where there is no glibc, nothing happens.
    """
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass
