"""A step's batch as this process runs it: split into inputs and targets, checked, and this replica's part taken."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dynmo_lightning.core.model import split_batch
from dynmo_lightning.pipeline.stage.runtime import first_dim
from dynmo_lightning.pipeline.topology.ranks import check_batch
from dynmo_lightning.pipeline.topology.world import World


def step_batch(
    module: Any, world: World, batch: Any, n_microbatches: int, *, train: bool = False
) -> tuple[Any, Tensor, int]:
    """``(inputs, target, batch size)`` of one step's ``batch`` (the size before a replica takes its part).

    A training batch is split into this replica's contiguous part of what its data shard delivered (replicas grown
    from released processes split their source replica's batches, see ``ReplicaLayout.regroup``). Evaluation
    batches are not split: replicas of one shard evaluate the same batch, which weighs equally in the mean.

    Args:
        module: the LightningModule (``pipeline_split_batch``, if any, splits the batch).
        world: the world in force (its layout says how a replica's batch is split).
        batch: what the dataloader gave.
        n_microbatches: micro-batches per step (the batch, or each part of it, must split into them).
        train: a training step's batch.
    """
    assert world.layout is not None, "a step runs after the strategy set up its environment"
    inputs, target = split_batch(module, batch)
    size = first_dim(inputs)
    check_batch(size, n_microbatches, world.layout.parts[world.dp_rank][1] if train else 1)
    if not train:
        return inputs, target, size
    inputs, target = world.layout.take_part(world.dp_rank, (inputs, target))
    return inputs, target, size
