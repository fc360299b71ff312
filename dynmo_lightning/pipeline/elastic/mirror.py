"""Copies of FSDP2 shards on a replica peer, so that a lost shard has another holder (``on_peer_lost="recover"``).

FSDP2 splits every layer of a stage over the stage's replica group: each process holds one place's shard of its
weights and of their optimizer state, and nobody else does. To go on after a loss without reading a checkpoint, each
process keeps, in host memory, a copy of its predecessor's shards in the group (place ``p`` sends its own to place
``p + 1`` mod ``D``) and a copy of its own, both of the state *before* the step in progress:

- after every optimizer step the processes exchange their new shards, then vote through the job manager's store
  (:meth:`~dynmo_lightning.pipeline.elastic.lost.InPlace.commit`, ``"held"``); only once every vote is in do the
  new copies replace the old ones (:meth:`ShardMirror.exchange`, :meth:`ShardMirror.promote`);
- a loss before that leaves every survivor rolled back to its own copy (:meth:`ShardMirror.restore`), so the
  survivors' shards and the copies of the lost shards are of the same state, and the step runs again;
- the new world's layers are made whole from the survivors' own shards and the copies they hold
  (:meth:`ShardMirror.copies`, read by :class:`~dynmo_lightning.pipeline.stage.reshape.Regather`).

A loss leaves the lost place's copy on its successor, a process of another replica, so any one loss in a replica
group is survived; further losses once the copies were exchanged in the new world. The cost: per process, host memory
for two shards of its stage's parameters and optimizer state (four while an exchange is in flight), and one shard's
traffic per step to its successor.

The copies hold what the optimizer and DynMo's own moves write. A layer that was migrated, consolidated or reshaped
holds new tensors, and the copies are exchanged again before the next step (:meth:`ShardMirror.current`); a process
whose copies do not name its layers' tensors offers none, and a loss then cannot be survived (it stops, as with
``"stop"``). Weights changed in place between steps by other code are not in the copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dynmo_lightning.pipeline.stage.reshape import chunk_shapes, cut_dim
from dynmo_lightning.pipeline.stage.slots import LayerSlots


def entries(slots: LayerSlots, optimizers: Sequence[Optimizer]) -> list[Tensor]:
    """Every tensor of the state of this process's layers in ``slots``, in an order every replica of a stage shares.

    Each parameter, then its optimizer state's tensors (by key): the sharded ones (DTensors) and the rest (a step
    count), which every replica holds alike.
    """
    seen: set[int] = set()
    out: list[Tensor] = []
    for layer in (slots.get(i) for i in slots.local_indices()):
        for p in layer.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append(p)
            for optimizer in optimizers:
                state = optimizer.state.get(p) or {}
                out.extend(v for _, v in sorted(state.items()) if isinstance(v, Tensor))
    return out


def holds_parts(tensors: Sequence[Tensor]) -> bool:
    """Whether some of ``tensors`` are split over the replica group (FSDP2's shards): what the copies are for.

    Replicas that hold their stages whole (DDP, replicate) need none: every intact replica holds every layer.
    """
    return any(_sharded(t) is not None for t in tensors)


def _sharded(t: Tensor) -> int | None:
    """The dimension ``t``'s replica-group placement cuts (``None``: held whole by every replica)."""
    return cut_dim(t.placements[0]) if isinstance(t, DTensor) else None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardMirror:
    """This process's own shards and its predecessor's, as of the last step every process finished.

    Args:
        device: where the exchange's buffers live (the process's device for NCCL, the host for gloo).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: The world the copies were made in (``InPlace.world``); ``-1``: none yet.
        self.world = -1
        #: The tensors the copies are of (their ``id``), in :func:`entries` order.
        self.ids: list[int] = []
        #: This process's place in its replica group and the group's size, at the copies.
        self.place, self.size = 0, 1
        #: Host copies of this process's state (every entry) and of its predecessor's sharded entries.
        self.own: list[Tensor] = []
        self.copy: dict[int, Tensor] = {}
        self._pending: tuple[list[Tensor], dict[int, Tensor]] | None = None
        self._next: tuple[int, list[int], int, int] = (-1, [], 0, 1)

    # --- the exchange ------------------------------------------------------------------------------------------------
    def exchange(self, tensors: list[Tensor], group: Any, world: int) -> None:
        """Send this process's shards to its successor and receive its predecessor's (collective over ``group``).

        The new copies wait in :attr:`_pending` until :meth:`promote`: a loss before every process holds its
        predecessor's leaves the last complete ones in force.
        """
        size, place = dist.get_world_size(group), dist.get_rank(group)
        own = [_local(t).detach().to("cpu", copy=True) for t in tensors]
        copy: dict[int, Tensor] = {}
        if size > 1:
            sent = [_local(t).reshape(-1).view(torch.uint8) for t in tensors if _sharded(t) is not None]
            payload = torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8)
            shapes = self._shapes(tensors, size, (place - 1) % size)
            incoming = torch.empty(sum(n for _, _, n in shapes), dtype=torch.uint8, device=self.device)
            successor, predecessor = (dist.get_global_rank(group, (place + d) % size) for d in (1, -1))
            ops = [dist.P2POp(dist.isend, payload.to(self.device), successor, group),
                   dist.P2POp(dist.irecv, incoming, predecessor, group)]  # fmt: skip
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            copy = _decode(incoming.cpu(), shapes, tensors)
        self._pending = (own, copy)
        self._next = (world, [id(t) for t in tensors], place, size)

    def promote(self) -> None:
        """Every process holds its predecessor's new copy: the new copies replace the old."""
        assert self._pending is not None
        (self.own, self.copy), self._pending = self._pending, None
        self.world, self.ids, self.place, self.size = self._next

    def discard(self) -> None:
        """The exchange did not complete everywhere: the last complete copies stay in force."""
        self._pending = None

    @staticmethod
    def _shapes(tensors: list[Tensor], size: int, place: int) -> list[tuple[int, torch.Size, int]]:
        """``(entry, shape, bytes)`` of each sharded entry's part at ``place`` of a group of ``size``."""
        out = []
        for i, t in enumerate(tensors):
            dim = _sharded(t)
            if dim is not None:
                shape = chunk_shapes(t.shape, dim, size)[place]
                out.append((i, shape, shape.numel() * t.dtype.itemsize))
        return out

    # --- after a loss ------------------------------------------------------------------------------------------------
    def current(self, tensors: list[Tensor], world: int) -> bool:
        """Whether the copies are of ``tensors`` (the same objects) in world ``world``."""
        return self.world == world and self.ids == [id(t) for t in tensors]

    def restore(self, tensors: list[Tensor], world: int) -> None:
        """Put this process's own copy back into ``tensors`` (the state before the step the loss interrupted)."""
        self.discard()
        if not self.current(tensors, world):
            return  # nothing to go back to: the caller's recovery will find no copies and stop
        with torch.no_grad():
            for t, saved in zip(tensors, self.own, strict=True):
                _local(t).copy_(saved)

    def copies(self, tensors: list[Tensor], world: int) -> dict[int, Callable[[DTensor], Tensor]]:
        """``{place: part of}``: the old places whose parts this process holds a copy of, besides its own.

        Empty where the copies are not of ``tensors`` in world ``world`` (layers changed since, or none yet).
        """
        if self.size < 2 or not self.current(tensors, world):
            return {}
        index = {id(t): i for i, t in enumerate(tensors)}
        return {(self.place - 1) % self.size: lambda t: self.copy[index[id(t)]]}


def _decode(flat: Tensor, shapes: list[tuple[int, torch.Size, int]], tensors: list[Tensor]) -> dict[int, Tensor]:
    """The predecessor's parts in ``flat``, by entry (of ``tensors``' dtypes: the predecessor's entries are alike)."""
    out, at = {}, 0
    for i, shape, n in shapes:
        out[i] = flat[at : at + n].clone().view(tensors[i].dtype).reshape(shape)  # aligned for its dtype
        at += n
    return out
