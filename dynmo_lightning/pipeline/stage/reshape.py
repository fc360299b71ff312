"""Changing a layer held in parts: stripped to its whole self, changed, and made parts again in place.

A layer under FSDP2 / replicate or tensor parallelism is held as DTensors: this process's shards (or parts) of its
weights and of their optimizer state. A change that needs the whole layer — structured pruning reads every unit's
weights to score it, and gives weights new shapes that a unit or a parallel style cannot follow — runs on a plain,
whole copy (:func:`whole_layer`: every part gathered over its mesh, the parallel parts' hooks left behind, as
migration's pickling leaves them), and the changed copy is made this process's parts again by the same loop as at
set-up (:func:`~dynmo_lightning.pipeline.stage.cut.apply_in_parts`: tensor parallel, compile, FSDP2 / replicate on the
meta device, each part filled from the whole value). The optimizer state goes the same way: gathered whole with the
layer, changed with it (``index_select_`` finds it in the optimizer stand-ins the change is given), and sharded again
like its parameter. At no moment does a process hold more than its parts of its layers plus the one layer whole.

Every process holding a part of the layer (its replicas, its tensor-parallel group) must reshape it together, in the
same order: gathering is collective over the layer's meshes. A layer held whole (DDP without tensor parallelism) is
changed where it is, with the real optimizers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.parallel.dtensors import shard_like
from dynmo_lightning.pipeline.stage.cut import apply_in_parts
from dynmo_lightning.pipeline.stage.migration import _optimizer_entries, _Packer, _unpack, pack_layers, unpack_layers
from dynmo_lightning.pipeline.stage.slots import LayerSlots

#: A change of a whole layer: ``(layer, optimizers)``, in place; the optimizers hold the layer's state (``.state``).
Change = Callable[[nn.Module, Sequence[Any]], None]


def held_in_parts(layer: nn.Module) -> bool:
    """Whether some parameter of ``layer`` is a DTensor (a shard, a tensor-parallel part or a replicate copy)."""
    return any(isinstance(p, DTensor) for p in layer.parameters())


def _resharded(layer: nn.Module) -> nn.Module:
    """``layer`` with its FSDP2 units resharded.

    A unit whose weights are gathered (between a forward and its reshard) registers plain tensors, which a change
    must not take for the layer's own.
    """
    StageSharding.reshard([layer])
    return layer


#: How a DTensor becomes whole: ``full_tensor`` over its mesh, or gathered from the shards of a world that ended.
Gather = Callable[[DTensor], Tensor]


def _full(t: DTensor) -> Tensor:
    return t.full_tensor()


class _WholePacker(_Packer):
    """Migration's packer, with every DTensor made whole by ``gather`` (collective, in pickling order)."""

    def __init__(self, file: io.BytesIO, device: torch.device, gather: Gather) -> None:
        super().__init__(file, device)
        self.gather = gather

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, DTensor):
            return super().persistent_id(obj)
        key = self._keys.get(id(obj))
        if key is None:
            with torch.no_grad():
                whole = self.gather(obj)
            key = self._keys[id(obj)] = len(self.tensors)
            self.tensors.append(whole.detach())
        return key, obj.requires_grad, isinstance(obj, nn.Parameter)


@dataclasses.dataclass
class OptimizerState:
    """Stands in for an optimizer while a whole copy of a layer changes: its ``state``, keyed by the copy's params."""

    state: dict[Tensor, dict[str, Any]] = dataclasses.field(default_factory=dict)


def whole_layer(
    layer: nn.Module, optimizers: Sequence[Optimizer], device: torch.device, gather: Gather = _full
) -> tuple[nn.Module, list[OptimizerState], dict[str, tuple[int, int, frozenset[str]]]]:
    """A plain copy of ``layer`` with whole tensors, its optimizer state whole (collective over the layer's meshes).

    ``gather`` makes a DTensor whole (``full_tensor``; after a world change, :class:`Regather`).

    Returns:
        The copy (plain modules of the layer's classes, without FSDP2's or the parallel styles' hooks), one
        :class:`OptimizerState` per optimizer holding the copy's parameters' state, and where each parameter sits
        in the optimizers with the keys of its state that were held in parts (``{name: (optimizer, group,
        keys)}``): they are made parts again like the parameter, the rest (a step count) stays as it is.
    """
    entries = _optimizer_entries(layer, optimizers)
    f = io.BytesIO()
    packer = _WholePacker(f, device, gather)
    packer.dump((layer, {name: state for name, (_, _, state) in entries.items()}))
    (copy, states), _ = _unpack(f.getvalue(), packer.tensors)
    params = dict(copy.named_parameters())
    views = [OptimizerState() for _ in optimizers]
    for name, (o, _, _) in entries.items():
        if states[name]:
            views[o].state[params[name]] = states[name]
    where = {name: (o, g, frozenset(k for k, v in state.items() if isinstance(v, DTensor)))
             for name, (o, g, state) in entries.items()}  # fmt: skip
    return copy, views, where


@contextlib.contextmanager
def whole(layer: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """Within: ``layer`` whole (a plain copy of a layer held in parts, collective; else the layer itself)."""
    if not held_in_parts(_resharded(layer)):
        yield layer
        return
    copy, _, _ = whole_layer(layer, (), device)
    yield copy


def reshape(
    slots: LayerSlots,
    index: int,
    change: Change,
    optimizers: Sequence[Optimizer],
    device: torch.device,
    parts: Callable[[int, nn.Module], None],
    gather: Gather = _full,
) -> None:
    """Apply ``change`` to layer ``index`` of ``slots`` whole (see the module docstring); the caller rebuilds stages.

    A layer held whole changes in place. A layer held in parts is gathered whole with its optimizer state and
    installed in its slots as that copy (its parts are freed: nothing else may hold them), changed, and made parts
    again in place by ``parts`` (``LocalStages``' tensor parallel, compile, FSDP2 / replicate); in every optimizer
    group its parameters keep their places, now the new parameters, with their state sharded like them.
    """
    layer = _resharded(slots.get(index))
    if not held_in_parts(layer):
        change(layer, optimizers)
        return
    copy, views, where = whole_layer(layer, optimizers, device, gather)
    places = _vacate(layer, {name: (o, g) for name, (o, g, _) in where.items()}, optimizers)
    slots.install(index, copy)
    del layer
    change(copy, views)
    states = {name: views[where[name][0]].state.pop(p, {}) for name, p in copy.named_parameters() if name in where}
    apply_in_parts(index, copy, device, parts)
    params = dict(copy.named_parameters())
    for name, state in states.items():  # what was held in parts, in parts again (not a step count)
        states[name] = {k: shard_like(v, params[name]) if k in where[name][2] else v for k, v in state.items()}
    _occupy(places, params, states, optimizers)


def _vacate(
    layer: nn.Module, where: dict[str, tuple[int, int]], optimizers: Sequence[Optimizer]
) -> dict[str, tuple[int, int, int]]:
    """Where each of ``layer``'s optimized parameters sits (optimizer, group, index); their state dropped.

    The layer is about to be replaced: :func:`_occupy` puts its successor's parameters in the same places.
    """
    params = dict(layer.named_parameters())
    places = {}
    for name, (o, g) in where.items():
        group = optimizers[o].param_groups[g]["params"]
        places[name] = (o, g, next(n for n, q in enumerate(group) if q is params[name]))
        optimizers[o].state.pop(params[name], None)
    return places


def _occupy(
    places: dict[str, tuple[int, int, int]],
    params: dict[str, Tensor],
    states: dict[str, dict[str, Any]],
    optimizers: Sequence[Optimizer],
) -> None:
    """Put the new ``params`` in the ``places`` :func:`_vacate` kept, with their ``states`` (if any)."""
    for name, (o, g, n) in places.items():
        optimizers[o].param_groups[g]["params"][n] = params[name]
        if states.get(name):
            optimizers[o].state[params[name]] = states[name]


# ---------------------------------------------------------------------------------------------------------------------
# A new world: every layer held in parts made parts again on the new meshes
# ---------------------------------------------------------------------------------------------------------------------
def rehome(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    device: torch.device,
    sharding: StageSharding,
    parts: Callable[[int, nn.Module], None],
    copies: Mapping[int, Callable[[DTensor], Tensor]] | None = None,
) -> None:
    """After the world changed (a consolidation, a growth): this process's layers as parts on the new meshes.

    Its DTensors still name the meshes of the world that ended. Where a process holds the same place in the new
    meshes as in the old (every consolidation that releases processes: the replicas and tensor-parallel peers of a
    kept stage stay together, in order), each layer is taken apart and made a unit again over the new groups around
    the very same local parts (:func:`~dynmo_lightning.pipeline.stage.migration.unpack_layers`: no copy, no
    communication). Where the replica group grew (``on_release="data_parallel"`` under ``fsdp`` / ``replicate``,
    with or without tensor parallelism: released processes hold a copy of a kept replica's parts, at its place in a
    group of the old size), every layer is gathered whole from the old parts over the new replica group and, for
    tensor-parallel parts, the stage's tensor-parallel group (:class:`Regather`), one layer at a time, and made parts
    of the new size (:func:`reshape`, the set-up's own loop).

    After a loss under FSDP2, a lost place's parts come from the ``copies`` a survivor holds of it
    (:meth:`~dynmo_lightning.pipeline.elastic.mirror.ShardMirror.copies`).

    Collective over every stage group of the new world (all processes call it, their layers in order).
    """
    indices = [i for i in slots.local_indices() if held_in_parts(slots.get(i))]
    if not indices:
        return
    if all(_same_places(slots.get(i), sharding) or _replicated(slots.get(i)) for i in indices):
        for i in indices:
            _in_place(slots, i, optimizers, device, sharding)
        return
    gather = Regather([slots.get(i) for i in indices], sharding, copies)
    for i in indices:
        reshape(slots, i, lambda layer, opts: None, optimizers, device, parts, gather)


def _meshes(layer: nn.Module) -> dict[tuple[str, ...], Any]:
    return {tuple(p.device_mesh.mesh_dim_names or ("dp",)): p.device_mesh for p in layer.parameters()
            if isinstance(p, DTensor)}  # fmt: skip


def _same_places(layer: nn.Module, sharding: StageSharding) -> bool:
    """Whether this process holds the same coordinates in the new meshes as in the old ones, of the same shapes."""
    for dims, old in _meshes(layer).items():
        new = sharding.mesh_of(dims)
        if tuple(old.shape) != tuple(new.shape) or _place_in(old) != _place_in(new):
            return False
    return True


def _replicated(layer: nn.Module) -> bool:
    """Whether every part of ``layer`` is whole on every process of its replica group (``replicate``'s units).

    Such a layer is a unit again around its own tensors whatever its place in the new group: after a loss the
    survivors of a replica group hold no place in common with the old one, and need none.
    """
    return all(
        all(placement.is_replicate() for placement in p.placements)
        for p in layer.parameters()
        if isinstance(p, DTensor)
    )


def _place_in(mesh: Any) -> tuple[int, ...]:
    """This process's coordinates in ``mesh`` (known without its groups: those of a world that ended are gone)."""
    return tuple(mesh.get_coordinate())


def _in_place(
    slots: LayerSlots, index: int, optimizers: Sequence[Optimizer], device: torch.device, sharding: StageSharding
) -> None:
    """Layer ``index`` a unit (split) again over the new meshes around its own local parts."""
    layer = slots.get(index)
    blob, tensors = pack_layers({index: layer}, optimizers, device)
    places = _vacate(layer, {name: (o, g) for name, (o, g, _) in _optimizer_entries(layer, optimizers).items()},
                     optimizers)  # fmt: skip
    del layer
    module, moved = unpack_layers(blob, tensors, sharding)[index]
    slots.install(index, module)
    _occupy(places, dict(module.named_parameters()), {name: state for name, (_, _, state) in moved.items()},
            optimizers)  # fmt: skip


class MissingParts(RuntimeError):
    """A DTensor cannot be made whole in the new world: no process holds some old place's part any more."""


class Regather:
    """Makes a DTensor of a world that ended whole from the parts the processes of a new replica group hold.

    Every process of the new group holds the part of one place (its coordinate) in a replica group of the old
    size (a kept replica's own, or the copy a released process received of it). For each old place, the first
    process of the new group holding it broadcasts its part over the new group; the parts are joined along the
    sharded dimension (``Shard``, torch's chunk layout), or taken as they are (``Replicate``). A layer split by tensor
    parallelism as well (FSDP2 / replicate over its parts: 2-D DTensors on ``("dp", "tp")``) is joined over the
    replicas first, which gives this process's tensor-parallel part (FSDP2 chunks that part, whatever the 2-D
    placement calls it), then over the stage's tensor-parallel group, whose processes keep their order in the new
    world.

    Args:
        layers: this process's layers held in parts (their meshes tell the old places).
        sharding: the new world's sharding (its replica group, and its tensor-parallel group).

    Raises:
        NotImplementedError: a layer split by tensor parallelism only (DDP replicas; refused before launch).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        sharding: StageSharding,
        copies: Mapping[int, Callable[[DTensor], Tensor]] | None = None,
    ) -> None:
        meshes = {dims: mesh for layer in layers for dims, mesh in _meshes(layer).items()}
        if not set(meshes) <= {("dp",), ("dp", "tp")}:
            raise NotImplementedError(f"re-sharding a layer over a grown replica group on meshes {sorted(meshes)}")
        old = next(iter(meshes.values()))
        self.group = sharding.mesh().get_group()
        self.old_size = old.size(0)
        self.place = _place_in(old)[0]
        self.copies = dict(copies or {})
        self.tp_group = None
        if ("dp", "tp") in meshes:
            assert sharding.tensor_parallel is not None
            self.tp_group = sharding.tensor_parallel.mesh().get_group()
            # the stage's tensor-parallel processes stay in order (``ReplicaLayout.regroup``)
            assert _place_in(meshes[("dp", "tp")])[1] == dist.get_rank(self.tp_group)
        # every process's old places: 2 its own, 1 a copy (pipeline/elastic/mirror.py), through the group's own device
        # (a tensor: NCCL moves no host objects)
        device = sharding.device if dist.get_backend(self.group) != "gloo" else torch.device("cpu")
        held = torch.zeros(self.old_size, dtype=torch.long)
        held[list(self.copies)] = 1
        held[self.place] = 2
        places = [torch.empty_like(held, device=device) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(places, held.to(device), group=self.group)
        table = torch.stack([t.cpu() for t in places])  # [new rank, old place]
        #: The new group's rank that sends each old place's part: its holder, else the first holding a copy
        #: (``None``: no process holds it any more, as after a loss without copies; only parts replicated over the
        #: old group, whole on every process, can then be made whole).
        self.sender = [int(table[:, j].argmax()) if int(table[:, j].max()) > 0 else None for j in range(self.old_size)]

    def __call__(self, t: DTensor) -> Tensor:
        """``t`` whole (collective over the new replica group, and its tensor-parallel group for a 2-D ``t``)."""
        dp, *tp = (cut_dim(p) for p in t.placements)
        shape = t.shape
        if tp and tp[0] is not None:  # this process's tensor-parallel part, as the plan cut it (torch's chunks)
            shape = chunk_shapes(shape, tp[0], self.tp_size)[dist.get_rank(self.tp_group)]
        local = t.to_local()
        if dp is not None:
            if None in self.sender:
                missing = [j for j, sender in enumerate(self.sender) if sender is None]
                raise MissingParts(f"the parts of places {missing} of the replica group are held by no process")
            me = dist.get_rank(self.group)
            mine = {j: self._part(t, j, local) for j in range(self.old_size) if self.sender[j] == me}
            local = _join(local, chunk_shapes(shape, dp, self.old_size), dp, mine, self.group, self.sender)
        if tp and tp[0] is not None:
            n, me = self.tp_size, dist.get_rank(self.tp_group)
            shapes = chunk_shapes(t.shape, tp[0], n)
            local = _join(local, shapes, tp[0], {me: local}, self.tp_group, list(range(n)))
        return local

    def _part(self, t: DTensor, place: int, local: Tensor) -> Tensor:
        """The part of old ``place`` this process sends: its own, or the copy it holds."""
        return local if place == self.place else self.copies[place](t).to(local.device)

    @property
    def tp_size(self) -> int:
        """Processes of the tensor-parallel group (1 without one)."""
        return 1 if self.tp_group is None else dist.get_world_size(self.tp_group)


def cut_dim(placement: Any) -> int | None:
    """The dimension a placement cuts; ``None``: ``Replicate``.

    ``Shard``, and the ``_StridedShard`` FSDP2 lays over a tensor-parallel cut of the same dimension: it cuts this
    process's tensor-parallel part in torch's chunks too.
    """
    return None if placement.is_replicate() else placement.dim


def chunk_shapes(shape: Sequence[int], dim: int, n: int) -> list[torch.Size]:
    """The shapes of ``n`` parts of ``shape`` cut along ``dim`` as ``torch.chunk`` cuts them (empty ones last)."""
    shapes = [c.shape for c in torch.empty(shape, device="meta").chunk(n, dim)]
    return shapes + [torch.Size([*shape[:dim], 0, *shape[dim + 1 :]])] * (n - len(shapes))


def _join(
    local: Tensor, shapes: list[torch.Size], dim: int, mine: Mapping[int, Tensor], group: Any, sender: list[int]
) -> Tensor:
    """The parts of ``shapes`` joined along ``dim``: part ``j`` broadcast by group rank ``sender[j]``.

    ``mine`` holds the parts this process sends; collective over ``group``.
    """
    parts = []
    for j, shape in enumerate(shapes):
        part = mine[j].contiguous() if j in mine else torch.empty(shape, dtype=local.dtype, device=local.device)
        dist.broadcast(part, group=group, group_src=sender[j])
        parts.append(part)
    return torch.cat(parts, dim)
