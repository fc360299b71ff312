"""Process groups that change size while training: shrink the world onto the ranks a repack keeps.

Lightning has no runtime hook for a smaller world, and since 2.5.2 it broadcasts a SIGTERM flag on the default
process group every batch, so released processes cannot simply stay in it. Consolidation therefore ends the default
process group on every process and starts a new one among the survivors (a fresh rendezvous on a port rank 0
chose and shared beforehand). The Lightning-facing view of the world (world size, global rank) is then served by
:class:`ResizedEnvironment`, which wraps the original cluster environment (Lightning's launcher, torchrun, SLURM)
and keeps its address, node and local rank, so devices stay where they were.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from dynmo_lightning.pipeline.topology.mesh import group_device
from dynmo_lightning.profiling import release_cached_memory

#: What a process released by consolidation does: leave at once, idle until training ends, or join other released
#: processes in a new data-parallel replica of the pipeline.
ON_RELEASE = ("exit", "wait", "data_parallel")

#: Store key rank 0 sets when training ends, releasing processes that wait (``on_release="wait"``).
SHUTDOWN_KEY = "dynmo/shutdown"

#: How long a released process waits for the end of training (``on_release="wait"``).
_RELEASED_WAIT = timedelta(days=7)


class ResizedEnvironment(ClusterEnvironment):
    """The job's cluster environment after the world changed size: same address and devices, new ranks.

    Args:
        base: the environment the job started with.
        world_size: processes in the new world.
        global_rank: this process's rank in it.
        main_port: the new world's rendezvous port.
    """

    def __init__(
        self,
        base: ClusterEnvironment,
        world_size: int,
        global_rank: int,
        main_port: int,
        local_rank: int | None = None,
        node_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.base = base.base if isinstance(base, ResizedEnvironment) else base
        self._world_size = world_size
        self._global_rank = global_rank
        self._main_port = main_port
        self._local_rank = local_rank
        self._node_rank = node_rank

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
        return self.base.local_rank() if self._local_rank is None else self._local_rank

    @override
    def node_rank(self) -> int:
        return self.base.node_rank() if self._node_rank is None else self._node_rank

    @override
    def teardown(self) -> None:
        self.base.teardown()


@dataclasses.dataclass(frozen=True)
class WorldView:
    """One survivor's place in the world after a shrink, as every launcher and Lightning describe it.

    Attributes:
        rank: global rank.
        world_size: processes in the world.
        local_rank: rank among the processes on this node.
        local_world_size: processes on this node.
        node_rank: this node's index among the nodes still running the job (rank 0's node first).
        num_nodes: nodes still running the job.
        main_port: the new world's rendezvous port.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    main_port: int

    def environ(self) -> dict[str, str]:
        """The variables torchrun and Lightning's launchers set, for this world."""
        return {
            "WORLD_SIZE": str(self.world_size),
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_PORT": str(self.main_port),
        }


def world_view(order: Sequence[int], me: int, nodes: Sequence[Hashable], main_port: int) -> WorldView:
    """The place of old global rank ``me`` among the survivors ``order`` (old global ranks, in new-rank order).

    Args:
        order: the survivors.
        me: a survivor.
        nodes: the node of every old global rank.
        main_port: the new world's rendezvous port.
    """
    kept = list(dict.fromkeys(nodes[g] for g in order))  # nodes in order of their first survivor: rank 0's first
    mates = [g for g in order if nodes[g] == nodes[me]]
    return WorldView(
        rank=order.index(me),
        world_size=len(order),
        local_rank=mates.index(me),
        local_world_size=len(mates),
        node_rank=kept.index(nodes[me]),
        num_nodes=len(kept),
        main_port=main_port,
    )


def check_shrink(keep_ranks: list[int], on_release: str, stages_per_rank: int) -> None:
    """Refuse a consolidation the world cannot make (messages name the setting)."""
    if on_release not in ON_RELEASE:
        raise ValueError(f"balancer.on_release={on_release!r} is not one of {list(ON_RELEASE)}")
    if stages_per_rank != 1:
        raise ValueError("consolidation needs one stage per rank (strategy.stages_per_rank=1)")
    if not keep_ranks or keep_ranks[0] != 0 or sorted(set(keep_ranks)) != keep_ranks:
        raise ValueError(f"keep_ranks={keep_ranks} must be ascending, distinct and start with rank 0")


def barrier(device: torch.device) -> None:
    """A barrier of the default group, for a process whose layers are on ``device`` (any backend, any device).

    NCCL's barrier runs on the GPU the process uses (``device_ids``); gloo's takes none.

    Raises:
        ValueError: the default group's backend cannot move tensors of ``device`` (a group an earlier fit left).
    """
    wire = group_device(device)
    dist.barrier(device_ids=[wire.index] if wire.type == "cuda" else None)


def free_port() -> int:
    """A TCP port that is free on this host right now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_store(address: str, timeout: timedelta, world_size: int | None = None) -> dist.TCPStore:
    """A key-value store server listening on a port the OS picks: the port is ours from the start, no race."""
    return dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)


def host_stores(n: int, address: str, timeout: timedelta) -> tuple[list[dist.TCPStore | None], list[int]]:
    """``n`` stores opened by rank 0 of the default group, and their ports, known to every process (collective).

    Returns:
        On rank 0 the open stores (the other processes connect to their ports); elsewhere ``None`` s.
    """
    stores: list[dist.TCPStore | None] = [None] * n
    if dist.get_rank() == 0:
        stores = [open_store(address, timeout) for _ in range(n)]
    payload = [[s.port if s is not None else 0 for s in stores]]
    dist.broadcast_object_list(payload, src=0)
    return stores, payload[0]


def restart_world(
    *,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    device: torch.device,
    store: dist.TCPStore | None = None,
) -> None:
    """Start a new default process group among the survivors (the old one must already be destroyed).

    Rank 0 passes the ``store`` it opened (:func:`host_stores`); the others connect to ``port``. The store is made
    here rather than from an ``init_method`` URL: under torchrun, URL rendezvous would look for the elastic agent's
    store instead (``TORCHELASTIC_USE_AGENT_STORE``).
    """
    if store is None:
        store = dist.TCPStore(address, port, world_size=world_size, is_master=False, timeout=timeout)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def rejoin(
    environment: ClusterEnvironment,
    order: Sequence[int],
    me: int,
    stores: Sequence[dist.TCPStore | None],
    ports: Sequence[int],
    *,
    nodes: Sequence[Hashable],
    backend: str,
    timeout: timedelta,
    device: torch.device,
) -> tuple[ResizedEnvironment, WorldView]:
    """Start a new world among ``order`` (the old default process group is already destroyed; collective).

    Every member's view then agrees: its :class:`ResizedEnvironment` and the variables of :meth:`WorldView.environ`
    in its environment.

    Args:
        environment: the job's cluster environment now.
        order: the members' ranks in the world before (old global ranks, or the ids ``nodes`` is indexed by), in the
            order of their new ranks.
        me: this process's entry of ``order``.
        stores: from :func:`host_stores`: the new world's rendezvous store first (open on rank 0 only).
        ports: their ports.
        nodes: the node of every entry ``order`` refers to.
        backend: the new world's process group backend.
        timeout: its timeout.
        device: this process's device.

    Returns:
        The environment of the new world (same address and devices, new ranks) and this process's place in it.
    """
    view = world_view(order, me, nodes, ports[0])
    restart_world(
        address=environment.main_address,
        port=ports[0],
        rank=view.rank,
        world_size=view.world_size,
        backend=backend,
        timeout=timeout,
        device=device,
        store=stores[0],
    )
    os.environ.update(view.environ())
    resized = ResizedEnvironment(environment, view.world_size, view.rank, ports[0], view.local_rank, view.node_rank)
    return resized, view


def release(address: str, control_port: int, on_release: str, device: torch.device, key: str) -> bytes | None:
    """End a released process's part in training: it holds no layers any more (it sent them all).

    With ``on_release="wait"`` it idles on the control store until rank 0 calls it back (``key`` is set: its value is
    returned) or training ends (:data:`SHUTDOWN_KEY`: ``None``); otherwise it returns ``None`` at once. The caller
    then ends the process with :func:`end_process`.
    """
    release_cached_memory(device)
    if on_release != "wait":
        return None
    store = dist.TCPStore(address, control_port, is_master=False, wait_for_workers=False, timeout=_RELEASED_WAIT)
    return wait_for_call(store, key)


def wait_for_call(store: dist.TCPStore, key: str, poll: float = 0.2) -> bytes | None:
    """Block until ``key`` is set (returns its value and deletes it) or training ends (``None``)."""
    deadline = time.monotonic() + _RELEASED_WAIT.total_seconds()
    while time.monotonic() < deadline:
        if store.check([SHUTDOWN_KEY]):
            return None
        if store.check([key]):
            value = store.get(key)
            store.delete_key(key)
            return value
        time.sleep(poll)
    return None


def end_process() -> NoReturn:
    """End a released process with exit status 0.

    It ends here rather than by raising through ``trainer.fit``, whose exception path would report the run as
    interrupted (callbacks' ``on_exception``, loggers finalized as failed); the callbacks were told
    (``on_released``) and the loggers finalized before.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
