"""The user's dataloaders sharded over the data-parallel replicas, in the user's order (:func:`shard_dataloader`)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


def shard_dataloader(dataloader: Any, shard: int, n_shards: int, seed: int) -> Any:
    """The user's dataloader as one shard of ``n_shards`` sees it: its order and its shuffle choice kept.

    Every stage of a pipeline must see the same batches. One pipeline (``n_shards == 1``) keeps the loader as it is,
    the order of single-device training, with one exception: a ``RandomSampler`` that draws from the global random
    state (which dropout consumes differently on every stage) becomes a ``DistributedSampler`` of one shard seeded
    with ``seed``: the same order on every process, fixed per epoch, so a resumed run sees the same batches. With
    replicas the data is sharded as DDP shards it, shuffled only if the user's loader shuffles (Lightning's own
    injection would always shuffle training data); other samplers are sharded around (``DistributedSamplerWrapper``).
    Loaders of iterable datasets, without batches, or already sharded over several replicas are left alone.
    """
    if _left_alone(dataloader):
        return dataloader
    sampler = dataloader.sampler
    plain = type(sampler) in (RandomSampler, SequentialSampler) and not getattr(sampler, "replacement", False)
    if not plain and not isinstance(sampler, DistributedSampler):  # sharded around
        if n_shards == 1:
            return dataloader
        wrapped = DistributedSamplerWrapper(sampler, num_replicas=n_shards, rank=shard, shuffle=False)
        return _update_dataloader(dataloader, wrapped)
    settings = _sampler_settings(sampler, n_shards, seed)
    if settings is None:
        return dataloader
    shuffle, seed, drop_last = settings
    if n_shards == 1 and not shuffle:
        return dataloader  # sequential: exactly the single-device order
    sharded = DistributedSampler(dataloader.dataset, n_shards, shard, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return _update_dataloader(dataloader, sharded)


def _left_alone(dataloader: Any) -> bool:
    """Whether :func:`shard_dataloader` keeps ``dataloader`` as it is, whatever the shards.

    Args:
        dataloader: the user's dataloader (or anything a Trainer call was given).

    Returns:
        True for a loader of an iterable dataset, one without batches, one already sharded over several replicas,
        and anything that is not a ``DataLoader``.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return True
    sampler = dataloader.sampler
    return dataloader.batch_sampler is None or (isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1)


def _sampler_settings(sampler: Any, n_shards: int, seed: int) -> tuple[bool, int, bool] | None:
    """The ``(shuffle, seed, drop_last)`` a sharding ``DistributedSampler`` keeps of ``sampler``.

    Args:
        sampler: a ``DistributedSampler`` of one shard, or a plain ``RandomSampler`` / ``SequentialSampler``.
        n_shards: shards the data is cut into.
        seed: the seed of a sampler that has none of its own.

    Returns:
        The settings, or ``None`` where the loader stays as it is: a ``DistributedSampler`` when there is one
        shard, or a ``RandomSampler`` the user seeded when there is one shard (every stage draws the same order).
    """
    if isinstance(sampler, DistributedSampler):  # one shard: keep its shuffle, seed and drop_last
        if n_shards == 1:
            return None
        return sampler.shuffle, sampler.seed, sampler.drop_last
    shuffle = isinstance(sampler, RandomSampler)
    if shuffle and sampler.generator is not None and n_shards == 1:
        return None  # the user seeded it: every stage draws the same order
    return shuffle, seed, False
