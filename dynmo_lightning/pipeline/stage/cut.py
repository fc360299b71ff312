"""Split a pipeline-ready module into stages: choose the first partition, drop other stages' layers, build ours.

The steps, in order (torchtitan's chain of named steps: plan, split, materialise):

1. :func:`pipeline_layers` - the module's layers, checked: each a distinct module, every parameter inside one, not
   already split by an earlier run;
2. :func:`initial_partition` - the first split (``"uniform"``, ``"params"`` or the user's list), checked against
   the schedule and the number of stages;
3. :func:`split_module` - replace other stages' layers by placeholders (their memory is freed) and materialise this
   stage's meta-device layers, each from its own seed, so a layer has the same initial weights on any stage;
4. :func:`build_in_parts` - where the processes of a stage hold parts of its layers (FSDP2 shards, tensor-parallel
   splits), each layer is built shard first: split and sharded on the meta device, given storage for its parts only,
   and filled from the host-initialised layer, one layer at a time. No process holds more than its parts plus one
   whole layer (on the host), so a stage too big for one device whole starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dynmo_lightning import balance
from dynmo_lightning.core.layer_init import materialise_layer
from dynmo_lightning.core.model import ProtocolError, check_protocol
from dynmo_lightning.core.parts import local_part
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.pipeline.stage.schedules import check_schedule
from dynmo_lightning.pipeline.stage.slots import LayerSlots, RemoteLayer
from dynmo_lightning.pipeline.stage.ties import Tie, find_ties

#: Initial partitions that ``DynMoStrategy(partition=...)`` accepts by name (or a list of layers per stage).
PARTITIONS = ("uniform", "params")


def pipeline_layers(module: nn.Module) -> list[nn.Module]:
    """The module's pipeline layers, checked for splitting.

    Raises:
        ProtocolError: the module is not pipeline-ready, was already split, or has parameters outside its layers.
    """
    layers = check_protocol(module)
    if any(isinstance(layer, RemoteLayer) for layer in layers):
        raise ProtocolError(
            f"{type(module).__name__} was already split into pipeline stages by another DynMoStrategy run; "
            "build a fresh module (or load it from a checkpoint) for a new Trainer."
        )
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in layer_params]
    if outside:
        raise ProtocolError(
            f"{type(module).__name__} has parameters outside its pipeline_layers(): {outside[:5]}. Every "
            "parameter must belong to a pipeline layer so that it lives on exactly one stage."
        )
    return layers


def count_params(layers: list[nn.Module]) -> list[int]:
    """Parameters of every layer (meta-device layers included)."""
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def initial_partition(
    partition: str | list[int],
    param_counts: list[int],
    *,
    pp_size: int,
    stages_per_rank: int,
    schedule: str,
    n_microbatches: int,
) -> list[int]:
    """Layers per stage at the start of training.

    Args:
        partition: ``"uniform"``, ``"params"`` or a list of layers per stage.
        param_counts: parameters of every layer.
        pp_size: processes of the pipeline.
        stages_per_rank: stages per process.
        schedule: the schedule's name (checked against the sizes).
        n_microbatches: micro-batches per step.

    Raises:
        ValueError: more stages than layers, a schedule that cannot run with these sizes, a list of the wrong length.
    """
    n_layers, n_stages = len(param_counts), pp_size * stages_per_rank
    if n_stages > n_layers:
        raise ValueError(
            f"{pp_size} processes x stages_per_rank={stages_per_rank} = {n_stages} pipeline stages, but the model "
            f"has only {n_layers} layers: every stage needs at least one layer. Use fewer devices (Trainer "
            "devices/num_nodes) or a deeper model."
        )
    check_schedule(schedule, pp_size, n_stages, n_microbatches)
    if isinstance(partition, list):
        if len(partition) != n_stages:
            raise ValueError(
                f"strategy.partition={partition} has {len(partition)} stages but the Trainer runs {pp_size} "
                f"processes x stages_per_rank={stages_per_rank} = {n_stages} stages: give one entry per stage, or "
                "change Trainer devices to match."
            )
        return balance.validate_partition(partition, n_layers, n_stages)
    if partition == "params":
        return balance.partition(param_counts, n_stages, method="params")
    return balance.partition([1.0] * n_layers, n_stages, method="uniform")


@dataclasses.dataclass
class SplitModel:
    """What splitting a module leaves behind on one process.

    Attributes:
        slots: where every layer sits in the module, and which ones this process holds.
        ties: parameters shared across layers (found before the split separated them).
        param_counts: parameters of every layer of the unsplit model.
        param_order: names of all parameters of the unsplit model, in its order.
        state_keys: the unsplit model's state-dict keys.
    """

    slots: LayerSlots
    ties: list[Tie]
    param_counts: list[int]
    param_order: list[str]
    state_keys: set[str]


def split_module(
    module: nn.Module,
    layers: list[nn.Module],
    plan: StagePlan,
    rank: int,
    device: torch.device,
    seed: int,
    parts: Callable[[int, nn.Module], None] | None = None,
) -> SplitModel:
    """Keep pipeline ``rank``'s layers of ``plan`` in ``module``; placeholders for the rest.

    Args:
        module: the LightningModule.
        layers: its :func:`pipeline_layers`.
        plan: the partition.
        rank: this process's pipeline rank.
        device: where this stage's layers are materialised.
        seed: base seed of the per-layer initialisation.
        parts: splits and shards a (meta-device) layer in place, ``(index, layer)``, where this process holds parts
            of its layers: every local layer is then built by :func:`build_in_parts`. ``None``: each process holds
            its layers whole, and meta-device layers are materialised on ``device``.
    """
    slots = LayerSlots(module, layers)
    model = SplitModel(
        slots,
        # Found before the split: materialising or dropping layers separates what they share.
        find_ties(module, layers, slots.names),
        count_params(layers),
        [name for name, _ in module.named_parameters()],
        set(module.state_dict().keys()),
    )
    mine = set(plan.layers_of_rank(rank))
    for i in range(len(layers)):
        if i not in mine:
            slots.remove(i)
    for i in sorted(mine):  # one layer at a time: its whole host copy is gone before the next one is made
        layer = slots.get(i)
        if parts is not None:
            build_in_parts(module, i, layer, seed, device, parts)
        elif any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
            materialise_layer(module, i, layer, seed, device)
    return model


def build_in_parts(
    module: nn.Module,
    index: int,
    layer: nn.Module,
    seed: int,
    device: torch.device,
    parts: Callable[[int, nn.Module], None],
) -> None:
    """Build layer ``index`` as this process's parts of it, on ``device``, holding it whole only on the host.

    The layer's values come from the host: a meta-device layer is materialised there from its seed (the values any
    stage would give it), a built one keeps its own. The layer then goes to the meta device, ``parts`` splits and
    shards it there (tensor parallel, compile, FSDP2 / replicate: nothing whole is allocated), ``to_empty`` gives
    its parts storage on ``device``, and each part is filled from the host value it is a part of.
    """
    if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
        materialise_layer(module, index, layer, seed, torch.device("cpu"))
    apply_in_parts(index, layer, device, parts)


def apply_in_parts(index: int, layer: nn.Module, device: torch.device, parts: Callable[[int, nn.Module], None]) -> None:
    """Make the real, whole ``layer`` (on the host or on ``device``) this process's parts of it, on ``device``.

    ``parts`` splits and shards it on the meta device, ``to_empty`` gives its parts storage, and each part is filled
    from the whole value it is a part of (no communication: every process holds the whole layer). The whole values
    are freed as the layer's tensors are replaced: afterwards this process holds its parts only.
    """
    # Aliases of the values: the layer's own tensors become meta ones below.
    values = {name: t.detach() for name, t in _tensors(layer)}
    shared = _shared_parameters(layer)
    layer.to(device="meta")
    _share_again(layer, shared)
    parts(index, layer)
    layer.to_empty(device=device)
    _share_again(layer, shared)
    with torch.no_grad():
        for name, t in _tensors(layer):
            local_part(t).copy_(_part_of(values.pop(name), t))


def _shared_parameters(layer: nn.Module) -> dict[str, str]:
    """``{name: the first name of the same parameter}`` for every parameter ``layer`` reaches by a second name."""
    first: dict[int, str] = {}
    return {name: first[id(p)] for name, p in layer.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}  # fmt: skip


def _share_again(layer: nn.Module, shared: dict[str, str]) -> None:
    """Make every second name of :func:`_shared_parameters` the first's parameter again (``Module.to`` splits them)."""
    for name, first in shared.items():
        parent, _, leaf = name.rpartition(".")
        layer.get_submodule(parent).register_parameter(leaf, layer.get_parameter(first))


def _tensors(layer: nn.Module) -> list[tuple[str, Tensor]]:
    return [*layer.named_parameters(), *layer.named_buffers()]


def _part_of(value: Tensor, like: Tensor) -> Tensor:
    """This process's part of the whole ``value``, laid out as ``like`` (no communication: every process has it)."""
    if not isinstance(like, DTensor):
        return value
    whole = value.to(like.device)  # the whole tensor on the device for a moment: one parameter, not the layer
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
