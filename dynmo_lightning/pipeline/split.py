"""Split a pipeline-ready module into stages: choose the first partition, drop other stages' layers, build ours.

The steps, in order (torchtitan's chain of named steps: plan, split, materialise):

1. :func:`pipeline_layers` - the module's layers, checked: each a distinct module, every parameter inside one, not
   already split by an earlier run;
2. :func:`initial_partition` - the first split (``"uniform"``, ``"params"`` or the user's list), checked against
   the schedule and the number of stages;
3. :func:`split_module` - replace other stages' layers by placeholders (their memory is freed) and materialise this
   stage's meta-device layers, each from its own seed, so a layer has the same initial weights on any stage.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dynmo_lightning import balance
from dynmo_lightning.core.layer_init import materialise_layer
from dynmo_lightning.core.model import ProtocolError, check_protocol
from dynmo_lightning.pipeline.layers import LayerSlots, RemoteLayer
from dynmo_lightning.pipeline.runtime import StagePlan, check_schedule
from dynmo_lightning.pipeline.ties import Tie, find_ties

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
    module: nn.Module, layers: list[nn.Module], plan: StagePlan, rank: int, device: torch.device, seed: int
) -> SplitModel:
    """Keep pipeline ``rank``'s layers of ``plan`` in ``module``; placeholders for the rest.

    Args:
        module: the LightningModule.
        layers: its :func:`pipeline_layers`.
        plan: the partition.
        rank: this process's pipeline rank.
        device: where this stage's meta-device layers are materialised.
        seed: base seed of the per-layer initialisation.
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
            continue
        layer = slots.get(i)
        if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
            materialise_layer(module, i, layer, seed, device)
    return model
