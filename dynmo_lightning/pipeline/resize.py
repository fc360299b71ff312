"""The worlds the strategy runs in: the first, each one a shrink or a grow starts, and the end.

:class:`Resizer` carries out :meth:`DynMoStrategy.shrink <dynmo_lightning.DynMoStrategy.shrink>` and
:meth:`~dynmo_lightning.DynMoStrategy.grow` (consolidating onto fewer processes, re-admitting them) and keeps what
lives from one world to the next: who is in the job (:class:`~dynmo_lightning.pipeline.elastic.ElasticWorld`) and the
heartbeats, one set per world (:class:`~dynmo_lightning.pipeline.watchdog.Heartbeats`). It is a collaborator of the
strategy, not a part of it, and its constructor is the whole interface: the strategy's public face as far as a
resize reads or sets it (:class:`ResizeHost`: the callbacks' ``PipelineControl`` and a few Lightning members), the
few internals it needs (:class:`ResizeInternals`) and the one action that changes the strategy's process groups.
It orchestrates the rooms that do the work: the layer moves (:class:`~dynmo_lightning.pipeline.stages.LocalStages`),
the new layout (:mod:`~dynmo_lightning.pipeline.layout`), the world's restart and everyone's view of it
(:mod:`~dynmo_lightning.pipeline.elastic`, :mod:`~dynmo_lightning.pipeline.groups`) and telling the job manager
(:mod:`~dynmo_lightning.pipeline.release`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.optim import Optimizer

from dynmo_lightning import balance
from dynmo_lightning.core.control import PipelineControl
from dynmo_lightning.pipeline import elastic, groups, release
from dynmo_lightning.pipeline.elastic import ElasticWorld
from dynmo_lightning.pipeline.layout import Mesh, ReplicaLayout
from dynmo_lightning.pipeline.migration import MigrationStats
from dynmo_lightning.pipeline.runtime import StagePlan
from dynmo_lightning.pipeline.stages import LocalStages
from dynmo_lightning.pipeline.watchdog import Heartbeats


class ResizeHost(PipelineControl, Protocol):
    """The strategy as a resize sees it: its public members only; the first two are set to the new world's.

    What callbacks see (:class:`~dynmo_lightning.protocol.PipelineControl`: partition, sizes, ``broadcast``, ...)
    and the members of a Lightning strategy below.

    Attributes:
        cluster_environment: the current world's environment (main address, ranks); set to the resized one.
        num_nodes: nodes running the job; set to the new world's.
        data_parallel_size: the replicas the job started with.
        tensor_parallel_size: the processes every stage is split over.
        heartbeat_timeout: seconds of silence after which a process counts as lost.
        process_group_backend: the backend of the new world (``None``: gloo).
    """

    cluster_environment: ClusterEnvironment | None
    num_nodes: int
    data_parallel_size: int
    tensor_parallel_size: int
    heartbeat_timeout: float
    process_group_backend: str | None

    @property
    def lightning_module(self) -> pl.LightningModule | None:
        """Its trainer: the step, the callbacks told of a release, the loops a re-admitted process continues."""

    @property
    def optimizers(self) -> list[Optimizer]:
        """Moved layers take their optimizer state along (edited in place)."""

    @property
    def root_device(self) -> torch.device:
        """This process's device (pinned at start-up)."""

    @property
    def global_rank(self) -> int:
        """This process's rank in the current world."""


@dataclass(frozen=True)
class ResizeInternals:
    """The strategy's internals a resize needs, as they are now (it asks again once the world changed).

    Attributes:
        stages: this process's stages; layers move through them (packed, migrated, run in the new world).
        layout: the job's replicas, their data shards and batch parts; a shrink regroups it.
        mesh: the job's process groups (the CPU control group agrees on copies; the new world's pipeline runs).
        batch_size: the last training step's batch size (rank 0's is what every process splits).
    """

    stages: LocalStages
    layout: ReplicaLayout
    mesh: Mesh
    batch_size: int | None


class Resizer:
    """The worlds of a strategy seen only through these arguments: started, shrunk, grown and ended.

    Args:
        host: the strategy's public face, as far as a resize reads it or sets it (:class:`ResizeHost`).
        internals: returns the strategy's :class:`ResizeInternals` now (asked again once the world changed).
        use_layout: makes the strategy adopt a layout in the current world (its process groups; collective).
        timeout: of every collective and rendezvous of a new world.
    """

    def __init__(
        self,
        host: ResizeHost,
        internals: Callable[[], ResizeInternals],
        use_layout: Callable[[ReplicaLayout], None],
        timeout: timedelta,
    ) -> None:
        self._host, self._internals, self._use_layout, self._timeout = host, internals, use_layout, timeout
        #: The job's processes across restarts of the world: their nodes, stable ids, who waits to come back.
        self.elastic = ElasticWorld()
        #: This process's heartbeats in the current world; their phases name what the job does, for failure messages.
        self.heartbeats = Heartbeats(host.heartbeat_timeout, self._step)

    def _step(self) -> int:
        module = self._host.lightning_module
        return module.trainer.global_step if module is not None else -1

    def start(self, node_rank: int) -> None:
        """Run in the first world: the even layout, every process's node, the heartbeats (collective)."""
        environment = self._host.cluster_environment
        assert environment is not None
        host = self._host
        self._use_layout(ReplicaLayout.even(host.world_size, host.data_parallel_size, host.tensor_parallel_size))
        self.elastic.start(node_rank)
        self.heartbeats.start(environment, *groups.host_stores(1, environment.main_address, self._timeout))

    def end(self) -> None:
        """Training ended: the heartbeats stop, and processes released with ``on_release="wait"`` may exit."""
        self.heartbeats.stop()
        self.elastic.end()

    @property
    def waiting(self) -> int:
        """Released processes a :meth:`grow` may re-admit now (one pipeline, one stage per rank only)."""
        host = self._host
        single = host.dp_size == 1 and host.stages_per_rank == 1 and host.pp_size >= 2
        return len(self.elastic.waiting) if single else 0

    def shrink(
        self,
        keep_ranks: list[int],
        layers_per_stage: list[int],
        *,
        on_release: str = "exit",
        release_to: release.ReleaseHandler | None = None,
    ) -> MigrationStats:
        """Consolidate every pipeline replica onto pipeline ranks ``keep_ranks``; release the others (collective).

        Layers move onto the kept ranks with their state; the survivors start a new world and agree on it (see
        :mod:`~dynmo_lightning.pipeline.elastic`). Released processes end with status 0 (``on_release="exit"``), wait
        to be called back by :meth:`grow` or the end of training (``"wait"``), or, with ``"data_parallel"``, those
        that make whole pipelines become replicas that split their source replica's batches.

        Args:
            keep_ranks: current pipeline ranks that keep running, ascending, starting with 0 (never released).
            layers_per_stage: the partition over the kept ranks.
            on_release: ``"exit"``, ``"wait"`` or ``"data_parallel"``.
            release_to: told of the release by rank 0 of the new world (e.g. to shrink the Slurm allocation); the
                environment it returns is applied on every survivor. Its failure is logged, never raised.
        """
        host, own, phase = self._host, self._internals(), self.heartbeats.phase
        assert host.cluster_environment is not None and host.lightning_module is not None
        groups.check_shrink(keep_ranks, on_release, host.stages_per_rank)
        lps = balance.validate_partition(layers_per_stage, host.n_layers, len(keep_ranks))
        # Every process must derive the same new layout: agree on the batch size it splits first.
        batch_size = host.broadcast(own.batch_size)
        layout, copies = own.layout.regroup(keep_ranks, on_release, batch_size, host.n_microbatches)
        # Rank 0 opens the new world's stores now, on ports no other process can take before they are used.
        stores, ports = groups.host_stores(3, host.cluster_environment.main_address, self._timeout)
        with phase(f"consolidation onto pipeline ranks {keep_ranks} (layer migration and copies)"):
            stats = own.stages.pack(keep_ranks, lps, copies, host.optimizers, own.mesh.control)
        with phase("consolidation (end of the old process group)"):
            dist.barrier()
        self.heartbeats.stop()  # the old world's heartbeats end with it (released processes fall silent on purpose)
        trainer, world = host.lightning_module.trainer, self._world_args()
        self.elastic.keep_control(stores[1], ports[1])
        if host.global_rank not in layout.order:
            call = self.elastic.leave(trainer, on_release, **world)
            return self._join(call, [None, None], call.pop("state"))  # called back by a grow
        environment, view, event = self.elastic.survive(
            layout.order, stores, ports, trainer.global_step, on_release, **world
        )
        host.cluster_environment = environment
        kept = StagePlan(tuple(lps), len(keep_ranks), host.schedule)
        self._adopt(view, layout.renumbered(), stores, ports, kept)
        host.partitions.append({"step": trainer.global_step, "layers_per_stage": lps})
        if release_to is not None and event.released_ranks:
            env = release.notify(release_to, event) if host.global_rank == 0 else {}
            release.apply_environment(host.broadcast(env))
        return stats

    def grow(self, layers_per_stage: list[int]) -> MigrationStats:
        """Re-admit released processes that wait, as new middle stages, and move layers onto them (collective).

        The same world restart as a shrink, in reverse; the called-back processes continue from the trainer's state
        at this step, and layers move with all their state, so the math does not change.

        Args:
            layers_per_stage: the partition of the grown pipeline (at most ``waiting`` more stages than now).
        """
        host = self._host
        assert host.cluster_environment is not None and host.lightning_module is not None
        lps = balance.validate_partition(layers_per_stage, host.n_layers)
        if not self.waiting or len(lps) - host.pp_size > self.waiting:
            raise ValueError(f"cannot grow to {len(lps)} stages: {self.waiting} released processes wait to come back")
        trainer = host.lightning_module.trainer
        stores, ports = groups.host_stores(2, host.cluster_environment.main_address, self._timeout)
        plan = self.elastic.call_plan(lps, host.layers_per_stage, ports, trainer.global_step)
        state = elastic.capture_trainer_state(trainer)  # on every process: callbacks' state_dict may be collective
        if host.global_rank == 0:
            self.elastic.call_back(plan, state)
        with self.heartbeats.phase("growth (end of the old process group)"):
            dist.barrier()
        self.heartbeats.stop()
        dist.destroy_process_group()
        return self._join(plan, stores, None)

    def _join(self, plan: dict[str, Any], stores: list[Any], state: dict[str, Any] | None) -> MigrationStats:
        """Start the grown world of ``plan`` and move layers onto its new stages (collective over it)."""
        host = self._host
        assert host.lightning_module is not None
        host.cluster_environment, view = self.elastic.join(plan, stores, **self._world_args())
        if state is not None:
            elastic.restore_trainer_state(host.lightning_module.trainer, state)
        padded = StagePlan(tuple(plan["padded"]), view.world_size, host.schedule)
        own = self._adopt(view, ReplicaLayout.even(view.world_size, 1), stores, plan["ports"], padded)
        with self.heartbeats.phase(f"growth onto {view.world_size} ranks (layer migration)"):
            grown = StagePlan(tuple(plan["plan"]), view.world_size, host.schedule)
            stats = own.stages.migrate(grown, host.optimizers)
        host.partitions.append({"step": plan["step"], "layers_per_stage": plan["plan"]})
        return stats

    def _world_args(self) -> dict[str, Any]:
        """What starting (or leaving) a world needs: the current environment, backend, timeout and this device."""
        host = self._host
        backend = host.process_group_backend or "gloo"
        return {"environment": host.cluster_environment, "backend": backend, "timeout": self._timeout,
                "device": host.root_device}  # fmt: skip

    def _adopt(
        self, view: groups.WorldView, layout: ReplicaLayout, stores: list[Any], ports: list[int], plan: StagePlan
    ) -> ResizeInternals:
        """Run ``plan`` (layers in place) with ``layout`` in the new world of ``view``; the internals there."""
        host = self._host
        assert host.cluster_environment is not None
        host.num_nodes = view.num_nodes
        rank_zero_only.rank = utils_rank_zero_only.rank = host.global_rank
        self._use_layout(layout)
        self.heartbeats.start(host.cluster_environment, stores, ports)
        own = self._internals()  # the new world's groups
        own.stages.adopt(plan, own.mesh.pipeline, host.optimizers)
        return own
