"""Tensors held in parts (FSDP2 shards, tensor-parallel splits): a process's part, and how many parts there are."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def local_part(t: Tensor) -> Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (FSDP2 sharding), any other tensor itself.

    Element-wise work on a layer's weights (pruning masks, norms summed per process) runs on this part, with no
    collective.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def held_parts(t: Tensor) -> int:
    """Into how many distinct parts the processes holding ``t`` split it (1: each holds it whole).

    A DTensor's shard placements (FSDP2's, tensor parallelism's, FSDP2's strided ones over tensor-parallel parts)
    split it over their mesh dimensions; its other dimensions hold copies. Sums over those processes weigh a part by
    this count to count every element alike.
    """
    parts = 1
    if isinstance(t, DTensor):
        for dim, placement in enumerate(t.placements):
            if placement.is_shard() or isinstance(placement, _StridedShard):  # a _StridedShard is no Shard
                parts *= t.device_mesh.size(dim)
    return parts
