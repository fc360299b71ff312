"""Tensors held in parts (FSDP2 shards, tensor-parallel splits): a process's part, how many, FSDP2's groups."""

from __future__ import annotations

from typing import Any

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


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP2 / replicate unit's state (``fully_shard.state(module)``), on any torch.

    torch 2.11 (the GPU image's) and earlier keep one group as ``state._fsdp_param_group`` (``None``: the unit
    holds no parameter of its own); torch 2.13 keeps a list, ``state._fsdp_param_groups``, and turns the singular
    one into a property that raises for a unit of several groups. Neither is public API: this is the one place the
    package reads them.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []
