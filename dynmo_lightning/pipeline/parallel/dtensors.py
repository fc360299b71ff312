"""Layers held as DTensors, as values: pickled as their parts, gathered whole, laid out like another DTensor."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import empty as dt_empty

from dynmo_lightning.core.parts import local_part as local
from dynmo_lightning.pipeline.parallel.compiled import COMPILED

#: ``nn.Module`` attributes that hold hooks (FSDP's are dropped when a sharded layer is pickled for migration).
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _plain_class(cls: type) -> type:
    """The module class FSDP2 or replicate derived ``cls`` from (``FSDPBlock`` -> ``Block``)."""
    return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))


class ShardedPickling:
    """Pickling helpers for layers whose parameters are DTensors (migration's ``Packer`` and ``Unpacker`` use them).

    Sending, an FSDP2 / replicate unit pickles as a plain module of its own class (FSDP's hooks and state left
    behind), and a DTensor as its local shard plus its global shape and placements. Receiving, a DTensor parameter
    comes back as a meta tensor of its global shape (:meth:`StageSharding.adopt` shards and fills it), any other
    DTensor (optimizer state, a mask) as a DTensor over the receiver's replica mesh around the received shard.
    """

    @staticmethod
    def reduce_unit(obj: Any) -> Any:
        """``Pickler.reducer_override``: a unit, or a module inside one, as a plain module without FSDP's hooks.

        The same for a module split by tensor parallelism: its parallel style's hooks stay behind.

        ``NotImplemented`` (pickle as usual) for everything else.
        """
        unit = isinstance(obj, FSDPModule)
        if not unit and not (isinstance(obj, nn.Module) and any(map(_from_fsdp, _hooks(obj)))):
            return NotImplemented
        state = dict(obj.__dict__)
        drop = set()
        for name in _HOOK_DICTS:
            kept = {k: h for k, h in state[name].items() if not _from_fsdp(h)}
            drop |= set(state[name]) - set(kept)
            state[name] = type(state[name])(kept)
        for name in _HOOK_FLAGS:
            state[name] = type(state[name])((k, v) for k, v in state[name].items() if k not in drop)
        for key in [k for k in state if k.startswith("__composable_api")]:
            del state[key]
        state.pop("_distribute_module_applied", None)  # a parallel style's mark: the layer is split again on arrival
        if state.pop(COMPILED, None) is not None:
            state.pop("forward", None)  # compiled again on arrival (pipeline/parallel/compiled.py)
        return _new_module, (_plain_class(type(obj)) if unit else type(obj),), state

    @staticmethod
    def dtensor_id(t: DTensor) -> tuple[Tensor, tuple[Any, ...]]:
        """The shard to send and what rebuilds the DTensor: ``(global shape, stride, placements, mesh dims)``."""
        dims = tuple(t.device_mesh.mesh_dim_names or ("dp",))
        return local(t).detach(), (tuple(t.shape), tuple(t.stride()), tuple(t.placements), dims)

    @staticmethod
    def dtensor_load(shard: Tensor, spec: tuple[Any, ...], is_param: bool, mesh_of: Callable[[tuple], Any]) -> Tensor:
        """A received DTensor: a meta placeholder of its global shape for a parameter, else a DTensor.

        The DTensor lies on this process's mesh of the same dimensions (``mesh_of``: :meth:`StageSharding.mesh_of`).
        """
        shape, stride, placements, dims = spec
        if is_param:
            return torch.empty(shape, dtype=shard.dtype, device="meta")
        mesh = mesh_of(dims)
        return DTensor.from_local(shard, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def full_tensors(obj: Any) -> Any:
    """``obj`` (a state dict, optimizer states) with every DTensor replaced by its whole tensor.

    Collective over each DTensor's mesh for sharded ones: every replica of the stage must call it, in the same
    order (the same layers and names on all of them).
    """
    return apply_to_collection(obj, DTensor, lambda t: t.full_tensor())


def shard_like(value: Tensor, like: Tensor) -> Tensor:
    """A whole tensor ``value`` as a DTensor laid out as ``like`` (each process keeps its part; no communication)."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def template_like(shape: Sequence[int], dtype: torch.dtype, like: Tensor | None) -> Tensor:
    """An empty tensor of a saved ``shape`` to read a checkpoint into: a DTensor laid out as ``like`` if that is one.

    DCP reads into it only the part this process holds.
    """
    if isinstance(like, DTensor):
        return dt_empty(*shape, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements)
    return torch.empty(tuple(shape), dtype=dtype)


def _new_module(cls: type) -> nn.Module:
    return cls.__new__(cls)


def _hooks(module: nn.Module) -> Iterable[Any]:
    return (h for name in _HOOK_DICTS for h in module.__dict__.get(name, {}).values())


#: Where FSDP2's, replicate's and tensor parallelism's (``distribute_module``'s input and output) hooks come from.
_DISTRIBUTED_HOOKS = ("torch.distributed.fsdp", "torch.distributed._composable", "torch.distributed.tensor")


def _from_fsdp(hook: Any) -> bool:
    """Whether a module hook is one of torch.distributed's (FSDP2's, a parallel style's), made again on arrival.

    Found behind partials and ``_WrappedHook``.
    """
    while isinstance(hook, functools.partial) or hasattr(hook, "hook"):
        hook = hook.func if isinstance(hook, functools.partial) else hook.hook
    return getattr(getattr(hook, "__func__", hook), "__module__", "").startswith(_DISTRIBUTED_HOOKS)
