"""Work that runs in the background over the world's process groups and must end before the world does.

An asynchronous checkpoint save (``pipeline/checkpoint/sharded.py``) writes from a thread over a process group of
its own, while training goes on. Destroying the default process group (a shrink, a grow, the end of the process)
destroys every subgroup with it, so the write would fail half-way: every place that ends a world calls
:func:`end_default_group`, which waits for such work first.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch.distributed as dist

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: list[tuple[str, Future]] = []


def track(what: str, future: Future) -> None:
    """Remember background ``future`` (named ``what`` in errors) until :func:`settle`."""
    with _lock:
        _pending.append((what, future))


def settle() -> None:
    """Wait for all background work; the first failure is raised (after all have ended).

    Raises:
        RuntimeError: a background write failed (its cause chained).
    """
    with _lock:
        pending = list(_pending)
        _pending.clear()
    failure: tuple[str, BaseException] | None = None
    for what, future in pending:
        error = future.exception()
        if error is not None and failure is None:
            failure = (what, error)
    if failure is not None:
        raise RuntimeError(f"{failure[0]} failed in the background: {failure[1]}") from failure[1]


def end_default_group() -> None:
    """Destroy the default process group (and its subgroups) once background work over them has ended."""
    try:
        settle()
    except RuntimeError as e:  # the world ends anyway; an earlier complete checkpoint is still in place
        log.error("%s", e)
    if dist.is_initialized():
        dist.destroy_process_group()
