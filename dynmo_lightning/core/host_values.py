"""Reading device values without stalling: scalar buffers the host knows, numbers read once for many."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

#: Why :func:`host_value` and :func:`has_host_value` run eagerly inside a compiled layer.
_OUT_OF_GRAPHS = (
    "a host value is host state: traced, dynamo would guard on the cached float and the buffer's version counter and "
    "compile again after every write (a threshold schedule: every step, until its recompile limit)"
)


@torch.compiler.disable(reason=_OUT_OF_GRAPHS)
def host_value(module: nn.Module, name: str) -> float:
    """The value of the scalar buffer ``module.<name>`` as a Python float, read from the device only when it changed.

    Thresholds, capacities and densities live in buffers so that they checkpoint and migrate with their layer, but
    reading a GPU buffer each forward stalls the stream. The value is cached with the buffer object and its version
    counter (bumped by every in-place write, ``load_state_dict`` included), so a forward reads the device only after
    something else wrote the buffer; :func:`set_host_value` writes without a read.

    Inside a compiled layer (``torch.compile``) it runs eagerly, as a graph break: the value enters the rest of the
    compiled code as an input, so a new value compiles nothing by itself (a branch it decides or a size it gives may,
    the first time), and nothing is read from the device that an eager step would not read.
    """
    if _known(module, name):
        return module.__dict__["_host_values"][name][2]
    buffer = getattr(module, name)
    value = float(buffer)  # the one read after an outside write
    module.__dict__.setdefault("_host_values", {})[name] = (buffer, buffer._version, value)
    return value


@torch.compiler.disable(reason=_OUT_OF_GRAPHS)
def has_host_value(module: nn.Module, name: str) -> bool:
    """Whether the host knows the current value of the scalar buffer ``module.<name>`` (no read would follow)."""
    return _known(module, name)


def _known(module: nn.Module, name: str) -> bool:
    buffer = getattr(module, name)
    cached = module.__dict__.get("_host_values", {}).get(name)
    return cached is not None and cached[0] is buffer and cached[1] == buffer._version


def set_host_value(module: nn.Module, name: str, value: float) -> None:
    """Write ``value`` into the scalar buffer ``module.<name>`` and remember it (no device read follows)."""
    buffer = getattr(module, name)
    with torch.no_grad():
        buffer.fill_(value)
    module.__dict__.setdefault("_host_values", {})[name] = (buffer, buffer._version, float(value))


def read_once(values: Sequence[Tensor | float]) -> list[float]:
    """Python numbers of ``values`` (scalar tensors or numbers) with one device read for all the tensors."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, Tensor) else float(v) for v in values]


class DeviceScalars:
    """Numbers recorded every step (losses) kept on the device until asked for, then read together.

    ``float(loss)`` in a step's hook waits for the device to finish the step; appending the tensor does not. The
    values come to the host in one read when :attr:`values` is asked for, or every ``flush_every`` appends (so the
    pending tensors stay few).

    Args:
        flush_every: most values kept on the device.
    """

    def __init__(self, flush_every: int = 256) -> None:
        self._read: list[float] = []
        self._pending: list[Tensor | float] = []
        self.flush_every = flush_every

    def append(self, value: Tensor | float) -> None:
        """Record ``value`` (a scalar tensor, detached here, or a number)."""
        self._pending.append(value.detach() if isinstance(value, Tensor) else float(value))
        if len(self._pending) >= self.flush_every:
            self._flush()

    @property
    def values(self) -> list[float]:
        """Every value recorded, as Python floats (reads the pending ones in one go)."""
        self._flush()
        return self._read

    def _flush(self) -> None:
        if self._pending:
            tensors = [v for v in self._pending if isinstance(v, Tensor)]
            read = iter(torch.stack([t.double().reshape(()) for t in tensors]).tolist() if tensors else [])
            self._read.extend(next(read) if isinstance(v, Tensor) else v for v in self._pending)
            self._pending = []
