"""Who is who in a DP x PP x TP job: pipeline replicas, tensor-parallel groups, data shards and THE rank mapping.

A job of ``W`` processes runs ``D`` replicas of a pipeline of ``P`` stages, each stage split over ``T`` processes
(tensor parallelism; ``T = 1`` without it). :class:`ReplicaLayout` holds the ``D T`` pipelines' global ranks by
pipeline rank (the ``("dp", "pp", "tp")`` device mesh, row by row), the data shard each replica's sampler reads and
which part of that shard's batches it trains on (replicas grown from released processes split the batches of the
replica they came from). Every translation between a pipeline rank and a global rank goes through
:meth:`ReplicaLayout.global_rank`; :mod:`~dynmo_lightning.pipeline.topology.mesh` creates a layout's process groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Replicas of the pipeline, the tensor-parallel groups inside them, and the data each replica trains on.

    A job of ``D x P x T`` processes runs ``D`` replicas of a pipeline of ``P`` stages whose every stage is split
    over ``T`` processes (tensor parallelism, innermost: process ``(d, p, t)`` has global rank ``(d P + p) T + t``,
    as torchtitan and Megatron lay out their meshes). The ``T`` processes of a stage compute together, so each
    replica runs ``T`` pipelines side by side, one per tensor-parallel rank ``t``, each sending its activations to
    the process of the same ``t`` on the next stage. Those ``D T`` pipelines are the :attr:`replicas` rows.

    Attributes:
        replicas: per pipeline, the global ranks of its processes by pipeline rank; row ``d T + t`` is replica
            ``d``'s pipeline of tensor-parallel rank ``t``.
        shards: per replica (``D`` of them), ``(shard, n_shards)`` of the dataset its sampler reads.
        parts: per replica, ``(part, n_parts)``: the contiguous part of its shard's batches it trains on.
        tp_size: processes a stage is split over (``T``); the ``T`` rows of a replica read the same data.
    """

    replicas: list[list[int]]
    shards: list[tuple[int, int]]
    parts: list[tuple[int, int]]
    tp_size: int = 1

    @classmethod
    def even(cls, world_size: int, data_parallel_size: int, tensor_parallel_size: int = 1) -> ReplicaLayout:
        """``data_parallel_size`` replicas on consecutive ranks, each reading its own shard whole.

        Inside a replica the ``tensor_parallel_size`` processes of a stage are consecutive (the fastest links).
        """
        d, t = data_parallel_size, tensor_parallel_size
        p = world_size // (d * t)
        rows = [[(i * p + r) * t + j for r in range(p)] for i in range(d) for j in range(t)]
        return cls(rows, [(i, d) for i in range(d)], [(0, 1)] * d, t)

    @property
    def dp_size(self) -> int:
        """Number of replicas."""
        return len(self.replicas) // self.tp_size

    @property
    def pp_size(self) -> int:
        """Processes of one pipeline."""
        return len(self.replicas[0])

    @property
    def n_shards(self) -> int:
        """Shards the data is cut into (fewer than the replicas when grown replicas share a shard)."""
        return self.shards[0][1]

    @property
    def order(self) -> list[int]:
        """Every global rank of the job, pipeline by pipeline (row by row), in pipeline order."""
        return [rank for replica in self.replicas for rank in replica]

    def row(self, global_rank: int) -> int:
        """Index of the pipeline (row of :attr:`replicas`) ``global_rank`` belongs to."""
        return next(i for i, ranks in enumerate(self.replicas) if global_rank in ranks)

    def dp_rank(self, global_rank: int) -> int:
        """Index of the replica ``global_rank`` belongs to."""
        return self.row(global_rank) // self.tp_size

    def tp_rank(self, global_rank: int) -> int:
        """Tensor-parallel rank of ``global_rank`` within its stage."""
        return self.row(global_rank) % self.tp_size

    def pp_rank(self, global_rank: int) -> int:
        """Pipeline rank of ``global_rank`` within its replica."""
        return self.replicas[self.row(global_rank)].index(global_rank)

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """Global rank of pipeline rank ``pp_rank`` of replica ``dp_rank``, tensor-parallel rank ``tp_rank``."""
        return self.replicas[dp_rank * self.tp_size + tp_rank][pp_rank]

    def stage_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """Global ranks holding the same part of pipeline rank ``pp_rank`` in every replica (its replica group)."""
        return [self.global_rank(pp_rank, d, tp_rank) for d in range(self.dp_size)]

    def tp_ranks(self, pp_rank: int, dp_rank: int) -> list[int]:
        """Global ranks that split pipeline rank ``pp_rank`` of replica ``dp_rank`` (its tensor-parallel group)."""
        return [self.global_rank(pp_rank, dp_rank, t) for t in range(self.tp_size)]

    def renumbered(self) -> ReplicaLayout:
        """The layout in a new world whose ranks are this layout's :attr:`order` (0, 1, ...)."""
        new = {rank: i for i, rank in enumerate(self.order)}
        rows = [[new[r] for r in replica] for replica in self.replicas]
        return ReplicaLayout(rows, self.shards, self.parts, self.tp_size)

    def take_part(self, dp_rank: int, batch: Any) -> Any:
        """Replica ``dp_rank``'s contiguous part of a training batch its shard delivered (tensors cut on dim 0)."""
        part, n_parts = self.parts[dp_rank]
        if n_parts == 1:
            return batch

        def cut(t: Tensor) -> Tensor:
            n = t.shape[0] // n_parts
            return t.narrow(0, part * n, n)

        return apply_to_collection(batch, Tensor, cut)

    def regroup(
        self, keep_ranks: list[int], on_release: str, batch_size: int | None, n_microbatches: int
    ) -> tuple[ReplicaLayout, list[tuple[int, int]]]:
        """The layout after every replica is packed onto its pipeline ranks ``keep_ranks``.

        With ``on_release="data_parallel"`` the processes a replica frees form as many new replicas of the smaller
        pipeline as they make whole, splitting the batches of the replica they came from, as long as a batch of
        ``batch_size`` divides into that many parts of whole micro-batches (otherwise fewer, with a warning).

        Returns:
            The new layout (in the current global ranks) and the ``(src, dst)`` global-rank pairs whose layers must
            be copied to make the new replicas.
        """
        # Under tensor parallelism a replica is T pipelines side by side (rows d T + t): each keeps its ranks at
        # ``keep_ranks``, so a stage's tensor-parallel group stays together, every process at its place; the
        # processes a replica frees at one pipeline rank are a whole tensor-parallel group again (the T rows free the
        # same ranks), and a new replica takes them row by row, so process t of a new stage copies process t of
        # the kept one (the same part of every layer).
        t_size = self.tp_size
        rows: list[list[int]] = []
        shards: list[tuple[int, int]] = []
        parts: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        p = len(keep_ranks)
        for d in range(self.dp_size):
            mine = self.replicas[d * t_size : (d + 1) * t_size]
            kept = [[ranks[r] for r in keep_ranks] for ranks in mine]
            freed = [[rank for r, rank in enumerate(ranks) if r not in keep_ranks] for ranks in mine]
            part, n_parts = self.parts[d]
            k = (
                _new_replicas(len(freed[0]), p, n_parts, batch_size, n_microbatches)
                if on_release == "data_parallel"
                else 1
            )
            for j in range(k):
                replica = kept if j == 0 else [row[(j - 1) * p : j * p] for row in freed]
                rows += replica
                shards.append(self.shards[d])
                parts.append((part * k + j, n_parts * k))
                if j:
                    copies += [pair for a, b in zip(kept, replica, strict=True) for pair in zip(a, b, strict=True)]
        return ReplicaLayout(rows, shards, parts, t_size), copies


def _new_replicas(freed: int, p: int, n_parts: int, batch_size: int | None, n_microbatches: int) -> int:
    """How many replicas a kept pipeline of ``p`` ranks and ``freed`` released processes make (itself included).

    As many as whole pipelines, and as split the replica's part of the batch evenly.
    """
    k = 1 + freed // p
    while k > 1 and not _splits_into(batch_size, n_microbatches, n_parts * k):
        k -= 1
    return k


def batch_error(batch_size: int, n_microbatches: int, n_parts: int = 1) -> ValueError | None:
    """Why a batch cannot be cut into ``n_parts`` replicas' parts of ``n_microbatches`` micro-batches, or ``None``.

    Args:
        batch_size: samples in the batch.
        n_microbatches: micro-batches each part runs.
        n_parts: replicas that split the batch (1 unless released processes became replicas).
    """
    if batch_size % n_parts:
        return ValueError(
            f"A batch of {batch_size} samples does not split into the {n_parts} replicas that share it (released "
            "processes joined as data-parallel replicas). Use batches that are full (drop_last=True) and a "
            "multiple of the replicas times strategy.n_microbatches."
        )
    if (batch_size // n_parts) % n_microbatches:
        return ValueError(
            f"A batch of {batch_size // n_parts} samples does not split into strategy.n_microbatches={n_microbatches} "
            f"equal micro-batches. Make the batch size a multiple of {n_microbatches} (and use drop_last=True so the "
            "last batch of an epoch is full), or change n_microbatches."
        )
    return None


def check_batch(batch_size: int, n_microbatches: int, n_parts: int = 1) -> None:
    """Raise :func:`batch_error`'s error, if there is one."""
    error = batch_error(batch_size, n_microbatches, n_parts)
    if error is not None:
        raise error


def _splits_into(batch_size: int | None, n_microbatches: int, n_parts: int) -> bool:
    """Whether a training batch splits into ``n_parts`` replicas' parts of whole micro-batches (warns if not)."""
    if batch_size is None:
        return False
    if batch_error(batch_size, n_microbatches, n_parts) is not None:
        rank_zero_warn(
            f"on_release='data_parallel': a batch of {batch_size} samples does not split into {n_parts} parts of "
            f"whole micro-batches (strategy.n_microbatches={n_microbatches}); fewer released processes become "
            "replicas (the rest exit)."
        )
        return False
    return True
