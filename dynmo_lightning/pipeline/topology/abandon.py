"""Abandon a broken world: every distributed call of this process that waits on a peer fails now.

When a process of the job dies, the survivors that talked to it directly see their calls fail, but a survivor waiting
on another *survivor* (a point-to-point receive in a pipeline group, an all-reduce among replicas that did not
include the lost process) waits until its group's timeout: its peer stopped to recover and will never send. Recovery
without a restart therefore starts with every survivor abandoning its groups, so that every wait of every survivor
ends at once and the survivors can meet.

* NCCL groups are aborted (``ProcessGroup.abort``: ``ncclCommAbort`` ends pending kernels).
* gloo's ``abort`` does nothing to an operation already waiting (torch 2.13; checked by
  ``tests/pipeline/test_abandon.py``), but gloo fails every pending operation of a context once one of its
  connections closes. So the connections *among the job's processes* are shut down: TCP sockets of this process
  whose local or remote port is a port some process of the job listens on (:func:`listening_ports`, gathered when a
  world starts, and this process's own at the time), except those of the store recovery meets at (``keep``).
  Sockets of other programs (a logger's service, a data server) do not touch the job's listening ports and stay
  open. Linux only (``/proc``); elsewhere
  nothing is shut and a waiting survivor ends at its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterable

import torch.distributed as dist

log = logging.getLogger(__name__)

_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _socket_inodes() -> dict[int, int]:
    """``{inode: fd}`` of this process's open sockets (empty where ``/proc`` is missing)."""
    inodes: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    inodes[int(target[8:-1])] = int(name)
    return inodes


def listening_ports() -> set[int]:
    """TCP ports this process listens on now (its gloo devices', a store it hosts); empty off Linux."""
    mine, ports = _socket_inodes(), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows, None)  # the header
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and fields[3] == _LISTEN and int(fields[9]) in mine:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def shut_connections(job_ports: Iterable[int], keep: Iterable[int] = ()) -> int:
    """Shut down this process's TCP connections that touch ``job_ports`` (local or remote port), except ``keep``.

    Args:
        job_ports: ports the job's processes listen on.
        keep: ports (of either end) whose connections stay open: the store the survivors meet at, a store this
            process hosts for the whole job.

    Returns:
        How many connections were shut down.
    """
    job, kept, shut = set(job_ports), set(keep), 0
    for fd in _socket_inodes().values():
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                local, remote = sock.getsockname()[1], sock.getpeername()[1]
            except OSError:  # not connected (a listener, a socket being opened)
                continue
            if not {local, remote} & kept and (local in job or remote in job):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
        finally:
            sock.detach()  # the fd stays the owner's (gloo's, the store's): it closes it itself
    return shut


def abandon_groups(job_ports: Iterable[int], keep: Iterable[int] = ()) -> None:
    """Make every pending distributed call of this process fail now (see the module docstring).

    Args:
        job_ports: ports the job's processes listen on (:func:`listening_ports` of every process).
        keep: ports (of either end) of connections that stay open.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        # torch's abort of every group (experimental, NCCL only: ncclCommAbort ends pending kernels); it unregisters
        # them all, as destroying the default group does. Not run on a GPU here (none lent).
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()
    # This process's own listeners now too: groups made after the job's ports were gathered (a tie's, a writer's)
    # have listeners of their own; every connection between two survivors has a listener on one side, whose owner
    # shuts it down when it abandons.
    shut = shut_connections(set(job_ports) | listening_ports(), keep)
    log.info("abandoned the world's groups: %d connections among the job's processes shut down", shut)
