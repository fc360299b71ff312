"""The user's dataloaders sharded over the data-parallel replicas, in the user's order (:func:`shard_dataloader`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)


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


class _From(Sampler):
    """``sampler``'s indices from position ``start`` on (a data shard resumed at a batch of its epoch)."""

    def __init__(self, sampler: Sampler, start: int) -> None:
        self.sampler, self.start = sampler, start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.start, 0)  # type: ignore[arg-type]


class TakenShards:
    """Batches of data shards a replica trains on besides its own: those of replicas lost without a restart.

    The batch of step ``i`` of shard ``s`` is the one the lost replica would have read: the same sampler (its
    shuffle, seed and epoch) over the same dataset, as one shard of the same number. Concatenated with the replica's
    own batch, every step still trains on the job's whole global batch.

    Args:
        dataloader: the replica's own training loader (sharded with a ``DistributedSampler``).
        shards: the shards it takes over.

    Raises:
        ValueError: the loader is not sharded by a ``DistributedSampler`` with a fixed batch size.
    """

    def __init__(self, dataloader: Any, shards: list[int]) -> None:
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(dataloader, DataLoader) or not isinstance(sampler, DistributedSampler):
            raise ValueError("taking over a lost replica's data needs a DataLoader sharded by a DistributedSampler")
        if dataloader.batch_size is None:
            raise ValueError("taking over a lost replica's data needs a DataLoader with a batch_size")
        self.dataloader, self.shards, self.batch_size = dataloader, shards, dataloader.batch_size
        settings = {"shuffle": sampler.shuffle, "seed": sampler.seed, "drop_last": sampler.drop_last}
        self._samplers = [DistributedSampler(dataloader.dataset, sampler.num_replicas, s, **settings) for s in shards]
        self._iterators: list[Iterator[Any]] = []
        self._next: tuple[int, int] | None = None  # (epoch, batch index) the iterators deliver next

    def batches(self, epoch: int, index: int) -> list[Any]:
        """The batch of step ``index`` of epoch ``epoch`` of every taken shard (in the order of :attr:`shards`)."""
        if self._next != (epoch, index):
            self._iterators = []
            for sampler in self._samplers:
                sampler.set_epoch(epoch)
                loader = _update_dataloader(self.dataloader, _From(sampler, index * self.batch_size))
                self._iterators.append(iter(loader))
        self._next = (epoch, index + 1)
        return [next(it) for it in self._iterators]
