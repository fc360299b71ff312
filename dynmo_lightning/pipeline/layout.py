"""Who is who in a DP x PP x TP job: pipeline replicas, tensor-parallel groups, data shards and THE rank mapping.

Also how the user's dataloaders are sharded over the replicas (:func:`shard_dataloader`).

A job of ``W`` processes runs ``D`` replicas of a pipeline of ``P`` stages, each stage split over ``T`` processes
(tensor parallelism; ``T = 1`` without it). :class:`ReplicaLayout` holds the ``D T`` pipelines' global ranks by
pipeline rank (the ``("dp", "pp", "tp")`` device mesh, row by row), the data shard each replica's sampler reads and
which part of that shard's batches it trains on (replicas grown from released processes split the batches of the
replica they came from). Every translation between a pipeline rank and a global rank goes through
:meth:`ReplicaLayout.global_rank`. :func:`make_mesh` creates the process groups of a layout, and
:func:`group_device` is THE choice of the device a group's tensors live on.
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


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


_CPU = torch.device("cpu")


def group_device(device: torch.device, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors ``group`` sends, broadcasts or reduces live, for a process whose layers are on ``device``.

    NCCL moves CUDA tensors only; gloo sends CPU tensors only (its collectives take CUDA tensors, its point-to-point
    does not): every gloo group's tensors, the control groups' included, live on the CPU. A ``"cpu:gloo,cuda:nccl"``
    group takes each device to its own backend.

    Args:
        device: where this process's layers live.
        group: the process group (``None``: the default group).

    Raises:
        ValueError: no backend of ``group`` moves tensors of ``device`` (e.g. a CPU fit in a process whose NCCL
            default group an earlier GPU fit left behind).
    """
    backend = str(dist.get_backend(group))
    per_type = dict(pair.split(":") for pair in backend.split(",")) if ":" in backend else {device.type: backend}
    chosen = per_type.get(device.type)
    if chosen == "gloo":
        return _CPU
    if chosen is None or (chosen == "nccl" and device.type != "cuda"):
        raise ValueError(
            f"The process group's backend {backend!r} cannot move tensors of {device}. A process group that an "
            "earlier fit in this process left behind is reused by Lightning: call "
            "torch.distributed.destroy_process_group() between fits, or run this fit on the devices of that backend "
            "(NCCL: CUDA; gloo: CPU)."
        )
    return device


@dataclasses.dataclass(frozen=True)
class PipelineGroup:
    """This process's pipeline: its pipeline rank, the process groups, and the members' global ranks.

    Point-to-point calls address global ranks; :meth:`global_rank` is how the pipeline runtime, layer migration and
    the strategy translate (a row of :attr:`ReplicaLayout.replicas`). Tensors of the layers travel on :attr:`group`;
    host data (pickled headers, flags, diffusion cards, checkpoint parts) on :attr:`control`, a gloo group of the same
    processes, where a message is a host copy instead of a device round trip.

    Attributes:
        rank: this process's pipeline rank.
        group: the pipeline's process group (``None``: the default group, when there is one replica).
        ranks: global rank of every pipeline rank.
        control: the pipeline's CPU (gloo) group (``None``: the default group, which is gloo then).
        device: where tensors on :attr:`group` live (:func:`group_device`).
        links: peers this process has opened a device link to on :attr:`group` (see ``transport.open_link``).
    """

    rank: int
    group: dist.ProcessGroup | None
    ranks: list[int]
    control: dist.ProcessGroup | None = None
    device: torch.device = _CPU
    links: set[int] = dataclasses.field(default_factory=set, compare=False, repr=False)

    @property
    def size(self) -> int:
        """Processes of the pipeline."""
        return len(self.ranks)

    def global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank``."""
        return self.ranks[pp_rank]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The process groups of a layout, seen from one process.

    Attributes:
        pipeline: this process's pipeline.
        dp_group: this process's part of its stage across the replicas (``None`` with one replica).
        control: the job's CPU (gloo) group of all processes (``None``: the default group, which is gloo then).
        layout: the layout the groups were made for.
        device_type: the processes' device type (of :attr:`device_mesh`).
        dp_control: :attr:`dp_group`'s CPU (gloo) twin, for host data between replicas (``dp_group`` itself under
            gloo; ``None`` with one replica).
        replica_group: the group FSDP2 / replicate units of this process's stage work over: :attr:`dp_group`, or
            with one replica a group of this process alone (``None`` when no units were asked for).
        tp_group: the processes this one splits its stage with (``None`` without tensor parallelism).
        stage_control: a CPU group of every process of this pipeline rank, in every replica and tensor-parallel
            rank (``None`` without tensor parallelism: :attr:`dp_control` is that group then). Host data every
            pipeline must agree on (the layer costs the balancer plans from) is averaged over it.
        own_group: with one replica, a group of this process alone on its device's backend where it had to be
            made with the others (:func:`own_group_needs_all`); ``None``: made on first use, if ever.
    """

    pipeline: PipelineGroup
    dp_group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    layout: ReplicaLayout
    device_type: str
    dp_control: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    stage_control: dist.ProcessGroup | None = None
    own_group: dist.ProcessGroup | None = None

    def part_groups(self, sharded: bool) -> list[dist.ProcessGroup]:
        """The groups a stage's layers are held in parts over (none: every process holds them whole).

        The replicas when ``sharded`` (FSDP2), and the tensor-parallel group.
        """
        found = [self.dp_group] if sharded and self.dp_group is not None else []
        return found + ([self.tp_group] if self.tp_group is not None else [])

    @functools.cached_property
    def replica_mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` of :attr:`replica_group` (the replicas of this stage, in replica order).

        Under tensor parallelism the ``"dp"`` dimension of :attr:`device_mesh`: FSDP2 shards a tensor-parallel
        parameter over both only when the two meshes come from one.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if self.replica_group is None:
            raise ValueError("the mesh was made without replica groups for FSDP2 / replicate units")
        if self.tp_group is not None:
            return self.stage_mesh["dp"]
        layout, pipe = self.layout, self.pipeline
        ranks = layout.stage_ranks(pipe.rank, layout.tp_rank(pipe.global_rank(pipe.rank)))
        return DeviceMesh.from_group(self.replica_group, self.device_type, mesh=ranks, mesh_dim_names=("dp",))

    @functools.cached_property
    def dp_dimension(self) -> dist.ProcessGroup:
        """The group of :attr:`device_mesh`'s ``"dp"`` dimension: the replicas of this stage.

        With one replica: :attr:`replica_group` where units need one, else :attr:`own_group` where it had to be made
        with the other processes, else a group of this process alone made on first use, by it alone
        (:func:`own_group`).
        """
        dp = self.dp_group or self.replica_group or self.own_group
        if dp is None:
            pipe = self.pipeline
            dp = own_group(pipe.global_rank(pipe.rank), None, pipe.device.type == "cpu")
        return dp

    @property
    def tp_mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` of :attr:`tp_group` (``"tp"`` of :attr:`stage_mesh`), where layers are split."""
        if self.tp_group is None:
            raise ValueError("the mesh was made without tensor parallelism")
        return self.stage_mesh["tp"]

    @functools.cached_property
    def stage_mesh(self) -> Any:
        """The ``("dp", "tp")`` ``DeviceMesh`` of this process's stage: its replicas by its tensor-parallel groups.

        The mesh FSDP2 / replicate shard tensor-parallel parts over (both 1-D meshes must come from one). Not sliced
        from :attr:`device_mesh`: torch (2.13) gives a mesh concatenated from slices around a ``"pp"`` dimension of
        size 1 (one stage, after a consolidation) another dimension's group.
        """
        from torch.distributed.device_mesh import DeviceMesh

        assert self.tp_group is not None
        layout, pipe = self.layout, self.pipeline
        ranks = [layout.tp_ranks(pipe.rank, d) for d in range(layout.dp_size)]
        return DeviceMesh.from_group(
            [self.dp_dimension, self.tp_group], self.device_type, mesh=ranks, mesh_dim_names=("dp", "tp")
        )

    @functools.cached_property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp")`` ``DeviceMesh`` over the same groups, ``("dp", "pp", "tp")`` under tensor parallelism.

        Made on first use (not collective). With one replica the ``"dp"`` dimension is a group of this process alone
        on its device's backend (:attr:`dp_dimension`): a user's ``fully_shard(mesh=device_mesh["dp"])`` works on
        it, NCCL on CUDA devices.
        """
        from torch.distributed.device_mesh import DeviceMesh

        pipe, layout = self.pipeline, self.layout
        dp = self.dp_dimension
        pp = pipe.group if pipe.group is not None else _group.WORLD
        if self.tp_group is None:
            return DeviceMesh.from_group([dp, pp], self.device_type, mesh=layout.replicas, mesh_dim_names=("dp", "pp"))
        ranks = [[layout.tp_ranks(p, d) for p in range(layout.pp_size)] for d in range(layout.dp_size)]
        return DeviceMesh.from_group(
            [dp, pp, self.tp_group], self.device_type, mesh=ranks, mesh_dim_names=("dp", "pp", "tp")
        )


def make_mesh(
    layout: ReplicaLayout, global_rank: int, timeout: timedelta, device: torch.device, unit_groups: bool = False
) -> Mesh:
    """Create the groups of ``layout`` (collective: every process of the job makes every group, in the same order).

    Only the groups something uses are made: with one pipeline the pipeline is the default group and there are no
    replica groups. With NCCL, CPU control groups are made too: one of the whole job and, with several pipelines,
    one per pipeline; these are made by their members only (with a device-bound NCCL default group, a non-member's
    ``new_group`` would join an NCCL communicator split the members never enter). The groups get the strategy's
    timeout (torch's default is 30 minutes).

    Args:
        layout: the replicas (and tensor-parallel groups).
        global_rank: this process's rank.
        timeout: timeout of every group.
        device: where this process's layers live.
        unit_groups: FSDP2 / replicate units will work over the replica groups: with one replica, each process
            gets a group of its own (:attr:`Mesh.replica_group`). With one replica on a device-bound default group
            (:func:`own_group_needs_all`) each process gets one anyway, for :attr:`Mesh.device_mesh`.

    Raises:
        ValueError: the default group's backend cannot move tensors of ``device`` (:func:`group_device`), or moves
            them only through the host (gloo with CUDA devices: stages could not send their activations).
    """
    wire = _wire_device(device)
    d, t, rows = layout.dp_size, layout.tp_size, len(layout.replicas)
    host = wire.type == "cpu"  # gloo groups: they carry host data themselves
    control = None if host else dist.new_group(backend="gloo", timeout=timeout)
    pp_ranks, dp_ranks, tp_ranks = _mesh_ranks(layout)
    # Every process makes every group, in this order (new_group is collective over the job).
    pp_group, pp_control = _new_groups(pp_ranks, global_rank, timeout, host)
    dp_group, dp_control = _new_groups(dp_ranks, global_rank, timeout, host)
    tp_group, _ = _new_groups(tp_ranks, global_rank, timeout, host)
    stage_control = _stage_control(layout, global_rank, timeout, host) if t > 1 and rows > 1 else None
    row = layout.row(global_rank)
    # One pipeline: the pipeline is the default group (as before data and tensor parallelism existed).
    pipeline = PipelineGroup(
        layout.pp_rank(global_rank), pp_group, list(layout.replicas[row]), pp_control if rows > 1 else control, wire
    )
    # A group of this process alone: made here where it needs every process of the pipeline. On a device-bound
    # NCCL world that is one split of each pipeline's communicator (all pipelines at once) and a one-process NCCL
    # communicator per process, made whether or not anything uses the public mesh's "dp" dimension.
    own = None
    if d == 1 and (unit_groups or own_group_needs_all(host)):
        own = own_group(global_rank, pp_group, host, timeout)
    replica_group = own if unit_groups and d == 1 else dp_group
    return Mesh(
        pipeline, dp_group, control, layout, device.type, dp_control, replica_group, tp_group, stage_control, own
    )


def _wire_device(device: torch.device) -> torch.device:
    """The device the default group's tensors live on, refused unless it is ``device`` itself.

    Args:
        device: where this process's layers live.

    Returns:
        ``device`` (what :func:`group_device` chose for the default group).

    Raises:
        ValueError: the default group moves ``device``'s tensors only through the host (stages could not send their
            activations).
    """
    wire = group_device(device)
    if wire != device:
        raise ValueError(
            f"process_group_backend={str(dist.get_backend())!r} sends CPU tensors only, and this process's layers are "
            f"on {device}: use 'nccl' (the default for CUDA devices)."
        )
    return wire


def _mesh_ranks(layout: ReplicaLayout) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The global ranks of the pipeline, replica and tensor-parallel groups :func:`make_mesh` makes for ``layout``.

    Only the groups something uses: the pipelines only when there are several (one pipeline is the default group),
    replica groups only with several replicas, tensor-parallel groups only with several processes per stage.

    Args:
        layout: the replicas (and tensor-parallel groups).

    Returns:
        ``(pipelines, replica groups, tensor-parallel groups)``, each in the order the groups are made (empty: none).
    """
    p, d, t = layout.pp_size, layout.dp_size, layout.tp_size
    pp_ranks = layout.replicas if len(layout.replicas) > 1 else []
    dp_ranks = [layout.stage_ranks(s, j) for s in range(p) for j in range(t)] if d > 1 else []
    tp_ranks = [layout.tp_ranks(s, i) for i in range(d) for s in range(p)] if t > 1 else []
    return pp_ranks, dp_ranks, tp_ranks


def _new_groups(
    all_ranks: list[list[int]], global_rank: int, timeout: timedelta, host: bool
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Make every group of ``all_ranks`` (and its CPU twin); this process's pair (collective over the job).

    Args:
        all_ranks: the global ranks of each group, in the order every process makes them.
        global_rank: this process's rank.
        timeout: timeout of every group.
        host: whether the default backend is gloo (a group is then its own CPU twin).

    Returns:
        ``(group, cpu twin)`` of the group holding ``global_rank``, ``(None, None)`` if none does.
    """
    mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout)
        # the CPU twin is made by its members only (see make_mesh)
        cpu = group if host else dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True)
        if global_rank in ranks:
            mine = (group, cpu)
    return mine


def _stage_control(layout: ReplicaLayout, global_rank: int, timeout: timedelta, host: bool) -> dist.ProcessGroup | None:
    """Make the CPU group of every pipeline rank's processes (all replicas and tensor-parallel ranks); this one's.

    Args:
        layout: the replicas (and tensor-parallel groups).
        global_rank: this process's rank.
        timeout: timeout of every group.
        host: whether the default backend is gloo (every process then makes every group).

    Returns:
        The group of this process's pipeline rank.
    """
    stage_control = None
    for s in range(layout.pp_size):
        ranks = [row[s] for row in layout.replicas]
        group = dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=not host)
        if global_rank in ranks:
            stage_control = group
    return stage_control


def own_group_needs_all(host: bool) -> bool:
    """Whether a group of one process on the device's backend needs every process of a parent group to make it.

    A device-bound default group (NCCL initialised with ``device_id``, as the strategy does on CUDA) splits its
    communicator for every new group, eagerly, with every process of the parent taking part (torch's
    ``_new_process_group_helper``: ``split_from`` and ``eager_connect_single_device``). gloo, and a default group
    that is not bound (communicators made lazily by their members), make it with its member alone.

    Args:
        host: whether the default group's backend moves this process's tensors through the CPU (gloo).
    """
    if host or not dist.is_initialized():
        return False
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None


def own_group(
    global_rank: int, parent: dist.ProcessGroup | None, host: bool, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """A group of this process alone on its device's backend (FSDP2 over one replica, a mesh's ``"dp"`` of one).

    gloo where the device's tensors travel through the CPU; else the default group's backend (NCCL on CUDA): with
    a device-bound default group every process of ``parent`` (``None``: the default group) gets its own in one
    split of ``parent`` (collective over it: call it together), not one world-wide split per process; otherwise
    made by this process alone (:func:`own_group_needs_all`).

    Args:
        global_rank: this process's rank.
        parent: the group whose processes make theirs together where they must.
        host: whether the default group's backend moves this process's tensors through the CPU (gloo).
        timeout: the group's timeout (``None``: torch's default).
    """
    if own_group_needs_all(host):
        group = dist.split_group(parent, [[r] for r in range(dist.get_world_size(parent))], timeout=timeout)
        assert group is not None  # every process of `parent` is in a split of its own
        return group
    backend = "gloo" if host else None
    return dist.new_group([global_rank], backend=backend, timeout=timeout, use_local_synchronization=True)


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
