"""LightningDataModule serving fixed-length windows of the standard-library byte corpus."""

from __future__ import annotations

import inspect
import os

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from dynmo_lightning.data.corpus import VOCAB_SIZE, CharWindowDataset, build_corpus, split_point


class StdlibCharDataModule(L.LightningDataModule):
    """Character (byte) language modelling on the Python standard library's sources.

    Batches are ``(inputs, targets)`` of shape ``(batch_size, block_size)``, ``int64``, with ``targets`` the inputs
    shifted by one token. The last ``val_fraction`` of the byte stream is the validation set. Both loaders drop the
    last incomplete batch, because a pipeline splits every batch into equal micro-batches.

    The corpus is rebuilt in :meth:`setup` on every process instead of in ``prepare_data``: it is cheap and
    deterministic, so every process (and every pipeline stage) holds identical data without sharing files.

    Args:
        block_size: Tokens per sequence.
        batch_size: Sequences per batch.
        max_bytes: Size cap of the corpus in bytes (= tokens).
        val_fraction: Share of the stream, taken from its end, used for validation; in ``(0, 1)``.
        num_workers: DataLoader worker processes.
        max_val_batches: If set, keep only this many validation batches so validation stays fast.
        seed: Seed of the training shuffle; the same seed gives the same batch order.
        root: Directory of ``.py`` sources to read instead of the running interpreter's standard library.

    Raises:
        ValueError: If a setting is out of range, or the corpus cannot fill one training and one validation batch.

    """

    block_size: int
    batch_size: int
    max_bytes: int
    val_fraction: float
    num_workers: int
    max_val_batches: int | None
    seed: int
    root: str | os.PathLike[str] | None

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        max_val_batches: int | None = None,
        seed: int = 0,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1, e.g. 0.05.")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be 0 (load in the main process) or more.")
        if max_val_batches is not None and max_val_batches < 1:
            raise ValueError(f"max_val_batches={max_val_batches} must be at least 1, or None for the whole split.")
        self.save_hyperparameters()
        # This class's arguments are also attributes (``dm.batch_size``, where Lightning's batch-size finder looks
        # first); a subclass's own arguments, which ``hparams`` holds too, stay the subclass's to set.
        for name in _ARGUMENTS:
            setattr(self, name, self.hparams[name])
        # Fail at construction rather than minutes later in setup() on every rank.
        self._check_corpus_size(max_bytes)
        self.train_dataset: CharWindowDataset | None = None
        self.val_dataset: CharWindowDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens (one per byte value)."""
        return VOCAB_SIZE

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch: ``batch_size * block_size``."""
        return self.batch_size * self.block_size

    @override
    def setup(self, stage: str) -> None:
        """Build the corpus and the train/validation windows; later calls reuse them.

        Args:
            stage: Lightning stage (``"fit"``, ``"validate"``, ...); every stage gets the same data.

        """
        if self.train_dataset is not None:
            return
        data = build_corpus(self.max_bytes, root=self.root)
        self._check_corpus_size(len(data))
        # clone() so the tensor owns its memory; a frombuffer view cannot be moved to shared memory for workers.
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        split = split_point(tokens.numel(), self.val_fraction)
        val_tokens = tokens[split:]
        if self.max_val_batches is not None:
            # +1: the last window needs one extra token for its final target.
            val_tokens = val_tokens[: self.max_val_batches * self.tokens_per_batch + 1]
        self.train_dataset = CharWindowDataset(tokens[:split], self.block_size)
        self.val_dataset = CharWindowDataset(val_tokens, self.block_size)

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Return shuffled training batches: the order of each epoch is fixed by ``seed`` and the epoch number.

        The sampler is a one-shard ``DistributedSampler``: its order depends on ``(seed, epoch)`` only (Lightning
        sets the epoch), so a run resumed at an epoch boundary sees the batches the uninterrupted run saw, and every
        process of a pipeline draws the same batches. Data-parallel replicas shard it further.
        """
        dataset = self._dataset(self.train_dataset)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=self.seed),
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Return validation batches in stream order."""
        return DataLoader(
            self._dataset(self.val_dataset),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _dataset(self, dataset: CharWindowDataset | None) -> CharWindowDataset:
        if dataset is None:
            raise RuntimeError("StdlibCharDataModule.setup() must run before asking for a dataloader.")
        return dataset

    def _check_corpus_size(self, n_bytes: int) -> None:
        need = _min_corpus_bytes(self.batch_size, self.block_size, self.val_fraction)
        if n_bytes >= need:
            return
        what = f"max_bytes={self.max_bytes}" if n_bytes == self.max_bytes else f"only {n_bytes} bytes of sources"
        raise ValueError(
            f"The corpus ({what}) is too small: batch_size={self.batch_size} x block_size={self.block_size} with "
            f"val_fraction={self.val_fraction} needs at least {need} bytes for one training and one validation "
            f"batch. Raise max_bytes to {need} or more, or lower block_size/batch_size."
        )


def _min_corpus_bytes(batch_size: int, block_size: int, val_fraction: float) -> int:
    """Smallest corpus whose train and validation splits each fill one batch of windows."""
    # One batch of windows spans batch_size * block_size tokens plus the last window's extra target.
    per_split = batch_size * block_size + 1
    n = max(1, int(per_split / min(val_fraction, 1.0 - val_fraction)) - 2)
    # Both split sizes grow monotonically with n and the estimate above is within a few tokens, so step up from it
    # with the exact rounding of split_point().
    while split_point(n, val_fraction) < per_split or n - split_point(n, val_fraction) < per_split:
        n += 1
    return n


#: The arguments of :class:`StdlibCharDataModule` itself (without ``self``).
_ARGUMENTS = tuple(inspect.signature(StdlibCharDataModule.__init__).parameters)[1:]
