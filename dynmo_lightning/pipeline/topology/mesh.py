"""The process groups and device mesh of one layout: :class:`Mesh`, :class:`PipelineGroup`, :func:`make_mesh`.

:func:`group_device` is THE choice of the device a group's tensors live on.
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import group as _group

from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout

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
