"""The world one process runs in now: its layout, process groups and meshes, cluster environment and heartbeats.

One :class:`World` per strategy, created with it and changed in place: set up when the environment is (the even
layout of the first world), then by every shrink and grow (and, next, a recovery) through :meth:`World.adopt`.
Collaborators (the stages, ties, sharding, tensor parallelism, clipping, evaluation, resizes) hold the world itself,
never a function that reads it back from the strategy, so what they see is always the world in force. "Before set-up"
is one state, :attr:`World.ready` false: the sizes then come from the settings, and what needs process groups says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from dynmo_lightning.pipeline.topology.heartbeats import Heartbeats
from dynmo_lightning.pipeline.topology.mesh import Mesh, PipelineGroup, make_mesh
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout


class StageWorld(Protocol):
    """What the parts of a stage read of the world in force (:class:`World` is one; :class:`FixedWorld` never changes).

    They hold it and read it when they act, never a copy: a resize changes the world in place.

    Attributes:
        layout: the job's replicas and tensor-parallel pipelines (``None``: one pipeline).
        row: this process's pipeline, its row of ``layout`` (ties make their groups per pipeline).
        pipeline: this process's pipeline (its group, ranks and device).
        holders: processes holding each stage: its replicas times its tensor-parallel processes.
        replica_mesh: the 1-D mesh of this process's replica group (FSDP2 / replicate units work over it).
        tp_mesh: the 1-D mesh this process splits its stage's layers over.
    """

    layout: ReplicaLayout | None
    row: int
    pipeline: PipelineGroup
    holders: int
    replica_mesh: Any
    tp_mesh: Any


@dataclasses.dataclass(frozen=True)
class FixedWorld:
    """A :class:`StageWorld` that never changes: stages built outside a job.

    Tests, benchmarks and the memory emulator build stages this way; one pipeline unless ``layout`` says otherwise.
    """

    replica_mesh: Any = None
    tp_mesh: Any = None
    layout: ReplicaLayout | None = None
    row: int = 0
    pipeline: PipelineGroup | None = None
    holders: int = 1


class World:
    """Where this process is in the job now, changed in place when the job's processes change.

    Args:
        data_parallel_size: the replicas the job starts with (the world's size before set-up).
        tensor_parallel_size: the processes every stage is split over.
        timeout: of every process group of a world.
        heartbeat_timeout: seconds a peer may stay silent before the job fails naming it.
        step: the trainer's step now (failure messages name it).
        unit_groups: FSDP2 / replicate units work over the replica groups (``make_mesh``'s ``unit_groups``).
    """

    def __init__(
        self,
        data_parallel_size: int,
        tensor_parallel_size: int,
        timeout: timedelta,
        heartbeat_timeout: float,
        step: Callable[[], int],
        unit_groups: bool = False,
    ) -> None:
        self.data_parallel_size, self.tensor_parallel_size = data_parallel_size, tensor_parallel_size
        self.timeout, self.unit_groups = timeout, unit_groups
        #: The world's cluster environment (ranks, main address); set by the Trainer, replaced by a resize.
        self.environment: ClusterEnvironment | None = None
        #: Nodes of the world (set by the Trainer, changed by a resize).
        self.num_nodes = 1
        #: This process's device, pinned at start-up: a shrink renumbers local ranks, not devices.
        self.device: torch.device | None = None
        #: The replicas, tensor-parallel groups, data shards and batch parts (``None`` before set-up).
        self.layout: ReplicaLayout | None = None
        #: The process groups and device meshes of :attr:`layout` (``None`` before set-up).
        self.mesh: Mesh | None = None
        #: One set of heartbeats per world; its phases name what the job does (a lost peer's error names it).
        self.heartbeats = Heartbeats(heartbeat_timeout, step)

    # --- the world in force ------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the world is set up (a layout adopted and its process groups made)."""
        return self.layout is not None and self.mesh is not None

    def adopt(
        self, layout: ReplicaLayout, environment: ClusterEnvironment | None = None, num_nodes: int | None = None
    ) -> None:
        """Run with ``layout``, in the current world or in the new one of ``environment`` (collective over it).

        The one place a world changes: its environment and nodes, the rank Lightning's rank-zero-only logging reads,
        the layout and every process group made for it.
        """
        if environment is not None:
            self.environment, self.num_nodes = environment, num_nodes or self.num_nodes
        rank_zero_only.rank = utils_rank_zero_only.rank = self.rank
        assert self.device is not None, "the device is pinned when the environment is set up"
        self.layout = layout
        self.mesh = make_mesh(layout, self.rank, self.timeout, self.device, unit_groups=self.unit_groups)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Within: the job does ``name`` (a lost peer's failure message names it)."""
        return self.heartbeats.phase(name)

    # --- who is who --------------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank (0 before the Trainer gives the environment)."""
        return self.environment.global_rank() if self.environment is not None else 0

    @property
    def size(self) -> int:
        """Processes of the world (1 before the Trainer gives the environment)."""
        return self.environment.world_size() if self.environment is not None else 1

    @property
    def holders(self) -> int:
        """Processes holding each stage: its replicas times its tensor-parallel processes."""
        return self.dp_size * self.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        """Processes of one pipeline."""
        return self.layout.pp_size if self.layout else self.size // self.holders

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank."""
        return self.layout.pp_rank(self.rank) if self.layout else self.rank % self.pp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the pipeline (grows when released processes form new ones)."""
        return self.layout.dp_size if self.layout else self.data_parallel_size

    @property
    def dp_rank(self) -> int:
        """Index of this process's replica."""
        return self.layout.dp_rank(self.rank) if self.layout else self.rank // self.pp_size

    @property
    def row(self) -> int:
        """This process's row of :attr:`layout` (its pipeline among the replicas and tensor-parallel pipelines)."""
        return self._set_up()[0].row(self.rank)

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank (empty before set-up)."""
        return [list(ranks) for ranks in self.layout.replicas] if self.layout else []

    # --- its groups --------------------------------------------------------------------------------------------------
    @property
    def pipeline(self) -> PipelineGroup:
        """This process's pipeline (its group, ranks and device)."""
        return self._set_up()[1].pipeline

    @property
    def host_group(self) -> dist.ProcessGroup | None:
        """The job's CPU (gloo) group for host data (``None``: the default group, which is gloo then)."""
        return self.mesh.control if self.mesh is not None else None

    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp")`` ``DeviceMesh`` of the job (``("dp", "pp", "tp")`` under tensor parallelism)."""
        return self.mesh.device_mesh if self.mesh is not None else None

    @property
    def replica_mesh(self) -> Any:
        """The mesh FSDP2 / replicate units of this process's stage work over."""
        return self._set_up()[1].replica_mesh

    @property
    def tp_mesh(self) -> Any:
        """The 1-D mesh this process splits its stage's layers over."""
        return self._set_up()[1].tp_mesh

    def part_groups(self, sharded: bool) -> list[dist.ProcessGroup]:
        """The groups holding other parts of this process's layers (FSDP2's replicas when ``sharded``, TP's)."""
        return self.mesh.part_groups(sharded) if self.mesh is not None else []

    def _set_up(self) -> tuple[ReplicaLayout, Mesh]:
        """The layout and the groups, which exist once the strategy set up its environment (``Trainer.fit``)."""
        if not self.ready:
            raise RuntimeError("the job's layout and process groups are made when the strategy sets up its environment")
        return self.layout, self.mesh  # type: ignore[return-value]  # ready: both are set
