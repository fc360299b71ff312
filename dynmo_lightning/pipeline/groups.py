"""Process groups that change size while training: shrink the world onto the ranks a repack keeps.

Lightning has no runtime hook for a smaller world, and since 2.5.2 it broadcasts a SIGTERM flag on the default
process group every batch, so released processes cannot simply stay in it. Consolidation therefore ends the default
process group on every process and starts a new one among the survivors (a fresh rendezvous on a port rank 0
chose and shared beforehand). The Lightning-facing view of the world (world size, global rank) is then served by
:class:`ResizedEnvironment`, which wraps the original cluster environment (Lightning's launcher, torchrun, SLURM)
and keeps its address, node and local rank, so devices stay where they were.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

#: Store key rank 0 sets when training ends, releasing processes that wait (``on_release="wait"``).
SHUTDOWN_KEY = "dynmo/shutdown"


class ResizedEnvironment(ClusterEnvironment):
    """The job's cluster environment after the world changed size: same address and devices, new ranks.

    Args:
        base: the environment the job started with.
        world_size: processes in the new world.
        global_rank: this process's rank in it.
        main_port: the new world's rendezvous port.
    """

    def __init__(self, base: ClusterEnvironment, world_size: int, global_rank: int, main_port: int) -> None:
        super().__init__()
        self.base = base.base if isinstance(base, ResizedEnvironment) else base
        self._world_size = world_size
        self._global_rank = global_rank
        self._main_port = main_port

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return self.base.creates_processes_externally

    @property
    @override
    def main_address(self) -> str:
        return self.base.main_address

    @property
    @override
    def main_port(self) -> int:
        return self._main_port

    @staticmethod
    @override
    def detect() -> bool:
        return False

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        self._world_size = size

    @override
    def global_rank(self) -> int:
        return self._global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._global_rank = rank

    @override
    def local_rank(self) -> int:
        return self.base.local_rank()

    @override
    def node_rank(self) -> int:
        return self.base.node_rank()

    @override
    def teardown(self) -> None:
        self.base.teardown()


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def share_ports(n: int) -> list[int]:
    """``n`` free ports chosen by rank 0 of the default group, known to every process (collective)."""
    ports = [free_port() for _ in range(n)] if dist.get_rank() == 0 else [0] * n
    payload = [ports]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def restart_world(
    *, address: str, port: int, rank: int, world_size: int, backend: str, timeout: timedelta, device: torch.device
) -> None:
    """Start a new default process group among the survivors (the old one must already be destroyed).

    The rendezvous store is created here rather than from an ``init_method`` URL: under torchrun, URL rendezvous
    would look for the elastic agent's store instead (``TORCHELASTIC_USE_AGENT_STORE``).
    """
    store = dist.TCPStore(address, port, world_size=world_size, is_master=rank == 0, timeout=timeout)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def control_store(address: str, port: int, *, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """The store released processes wait on (``on_release="wait"``) until rank 0 says training ended."""
    return dist.TCPStore(address, port, is_master=is_master, wait_for_workers=False, timeout=timeout)
