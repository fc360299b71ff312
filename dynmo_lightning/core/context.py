"""What the forward in progress is: a shape probe or recomputation, host-only work, one stage forward.

Three process-wide flags that layers and counters read (set by the runtime around the work they mark).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_probing = False


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Mark a forward pass that must not count: layers must not update statistics.

    Shape probes (they only discover activation shapes) and the recomputation of checkpointed layers in backward
    (it repeats a forward already counted; :mod:`dynmo_lightning.recompute`) run under it.
    """
    global _probing
    previous, _probing = _probing, True
    try:
        yield
    finally:
        _probing = previous


def is_probing() -> bool:
    """True inside :func:`probing`; dynamic layers skip their bookkeeping then."""
    return _probing


_on_host = False


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Mark work on host data only: CPU tensors of a CPU (gloo) process group, pickled control messages.

    None of it reads or waits for the accelerator (under NCCL these groups never touch the device), so
    ``HostSyncCounter`` counts what runs inside apart (``[host]``); on a CPU-only run it could not tell otherwise.
    Only wrap code whose tensors are all made and kept on the host.
    """
    global _on_host
    previous, _on_host = _on_host, True
    try:
        yield
    finally:
        _on_host = previous


def is_on_host() -> bool:
    """True inside :func:`on_host`."""
    return _on_host


_stage_memo: dict[str, Any] | None = None


@contextlib.contextmanager
def stage_forward() -> Iterator[dict[str, Any]]:
    """Mark one forward of a stage's layers on one micro-batch; layers share host-side values in its memo.

    A value read from the device once per stage forward (e.g. an upper bound on the active tokens, which exits only
    lower) serves every later layer of the stage, so the forward pays one host synchronisation, not one per layer.
    """
    global _stage_memo
    previous, _stage_memo = _stage_memo, {}
    try:
        yield _stage_memo
    finally:
        _stage_memo = previous


def stage_memo() -> dict[str, Any] | None:
    """The memo of the :func:`stage_forward` in progress (``None`` outside one)."""
    return _stage_memo
