"""The worlds the strategy runs in: the first, each one a shrink or a grow starts, and the end.

:class:`Resizer` carries out :meth:`DynMoStrategy.shrink <dynmo_lightning.DynMoStrategy.shrink>` and
:meth:`~dynmo_lightning.DynMoStrategy.grow` (consolidating onto fewer processes, re-admitting them) and keeps who is
in the job from one world to the next (:class:`~dynmo_lightning.pipeline.elastic.ElasticWorld`). It is a collaborator
of the strategy, not a part of it, and its constructor is the whole interface: what a resize reads of the strategy
(:class:`ResizeHost`, nothing more), the few internals it needs (:class:`ResizeInternals`), the one action that
changes the strategy's world (its environment, nodes and process groups) and the strategy's heartbeats, which a
resize stops and starts with each world. It never writes into the strategy: a shrink or grow returns a
:class:`Resized` outcome whose partition the strategy records (one writer of the partition history).
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
from torch.optim import Optimizer

from dynmo_lightning import balance
from dynmo_lightning.pipeline import elastic, groups, release
from dynmo_lightning.pipeline.elastic import ElasticWorld
from dynmo_lightning.pipeline.layout import Mesh, ReplicaLayout
from dynmo_lightning.pipeline.migration import MigrationStats
from dynmo_lightning.pipeline.runtime import StagePlan
from dynmo_lightning.pipeline.stages import LocalStages
from dynmo_lightning.pipeline.watchdog import Heartbeats


class ResizeHost(Protocol):
    """The strategy as a resize reads it, and nothing else (the house test holds this list to what resize.py uses).

    Attributes:
        cluster_environment: the current world's environment (main address, ranks).
        process_group_backend: the backend of a new world (``None``: gloo).
        data_parallel_size: the replicas the job started with.
        tensor_parallel_size: the processes every stage is split over.
        n_microbatches: micro-batches per step (a regrouped layout splits the batch into them).
        schedule: the pipeline schedule (the stage plans of a new world).
    """

    cluster_environment: ClusterEnvironment | None
    process_group_backend: str | None
    data_parallel_size: int
    tensor_parallel_size: int
    n_microbatches: int
    schedule: str

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

    @property
    def world_size(self) -> int:
        """Processes in the current world."""

    @property
    def dp_size(self) -> int:
        """Pipeline replicas now."""

    @property
    def pp_size(self) -> int:
        """Pipeline ranks now."""

    @property
    def stages_per_rank(self) -> int:
        """Stages every pipeline rank runs."""

    @property
    def n_layers(self) -> int:
        """Pipeline layers of the model."""

    @property
    def layers_per_stage(self) -> list[int]:
        """The partition now."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every process (host data over the job's CPU group)."""


class EnterWorld(Protocol):
    """The strategy's one action that changes its world: adopt ``layout`` (collective over the current world).

    With ``environment``, the strategy first moves into that new world (its environment, ``num_nodes`` and the rank
    rank-zero-only logging reads).
    """

    def __call__(
        self, layout: ReplicaLayout, environment: ClusterEnvironment | None = None, num_nodes: int | None = None
    ) -> None:
        """Adopt ``layout`` (in the world of ``environment`` with ``num_nodes`` nodes, when given)."""


@dataclass(frozen=True)
class Resized:
    """What a shrink or grow did, for the strategy to record.

    Attributes:
        stats: the layer moves it made (with a shrink's copies).
        partition: ``{"step", "layers_per_stage"}`` of the new world: the strategy appends it to its history.
    """

    stats: MigrationStats
    partition: dict[str, Any]


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
        host: what a resize reads of the strategy (:class:`ResizeHost`); it never writes into it.
        internals: returns the strategy's :class:`ResizeInternals` now (asked again once the world changed).
        enter: makes the strategy adopt a layout, in the current world or a new one (:class:`EnterWorld`).
        heartbeats: the strategy's heartbeats; every world has its own, stopped and started here with the world.
        timeout: of every collective and rendezvous of a new world.
    """

    def __init__(
        self,
        host: ResizeHost,
        internals: Callable[[], ResizeInternals],
        enter: EnterWorld,
        heartbeats: Heartbeats,
        timeout: timedelta,
    ) -> None:
        self._host, self._internals, self._enter, self._timeout = host, internals, enter, timeout
        self._heartbeats = heartbeats
        #: The job's processes across restarts of the world: their nodes, stable ids, who waits to come back.
        self._elastic = ElasticWorld()

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a shrink (ranks, hosts, whole nodes freed)."""
        return self._elastic.releases

    def pipeline_nodes(self, layout: ReplicaLayout) -> list[Any]:
        """The node of every pipeline rank of ``layout`` (with replicas: the tuple of their nodes)."""
        return self._elastic.pipeline_nodes(layout)

    def start(self, node_rank: int) -> None:
        """Run in the first world: the even layout, every process's node, the heartbeats (collective)."""
        environment = self._host.cluster_environment
        assert environment is not None
        host = self._host
        self._enter(ReplicaLayout.even(host.world_size, host.data_parallel_size, host.tensor_parallel_size))
        self._elastic.start(node_rank)
        self._heartbeats.start(environment, *groups.host_stores(1, environment.main_address, self._timeout))

    def end(self) -> None:
        """Training ended: the heartbeats stop, and processes released with ``on_release="wait"`` may exit."""
        self._heartbeats.stop()
        self._elastic.end()

    @property
    def waiting(self) -> int:
        """Released processes a :meth:`grow` may re-admit now (one pipeline, one stage per rank only)."""
        host = self._host
        single = host.dp_size == 1 and host.stages_per_rank == 1 and host.pp_size >= 2
        return len(self._elastic.waiting) if single else 0

    def shrink(
        self,
        keep_ranks: list[int],
        layers_per_stage: list[int],
        *,
        on_release: str = "exit",
        release_to: release.ReleaseHandler | None = None,
    ) -> Resized:
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
        host, own, phase = self._host, self._internals(), self._heartbeats.phase
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
        self._heartbeats.stop()  # the old world's heartbeats end with it (released processes fall silent on purpose)
        trainer, world = host.lightning_module.trainer, self._world_args()
        self._elastic.keep_control(stores[1], ports[1])
        if host.global_rank not in layout.order:
            call = self._elastic.leave(trainer, on_release, **world)
            return self._join(call, [None, None], call.pop("state"))  # called back by a grow
        environment, view, event = self._elastic.survive(
            layout.order, stores, ports, trainer.global_step, on_release, **world
        )
        kept = StagePlan(tuple(lps), len(keep_ranks), host.schedule)
        self._adopt(environment, view, layout.renumbered(), stores, ports, kept)
        if release_to is not None and event.released_ranks:
            env = release.notify(release_to, event) if host.global_rank == 0 else {}
            release.apply_environment(host.broadcast(env))
        return Resized(stats, {"step": trainer.global_step, "layers_per_stage": lps})

    def grow(self, layers_per_stage: list[int]) -> Resized:
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
        plan = self._elastic.call_plan(lps, host.layers_per_stage, ports, trainer.global_step)
        state = elastic.capture_trainer_state(trainer)  # on every process: callbacks' state_dict may be collective
        if host.global_rank == 0:
            self._elastic.call_back(plan, state)
        with self._heartbeats.phase("growth (end of the old process group)"):
            dist.barrier()
        self._heartbeats.stop()
        dist.destroy_process_group()
        return self._join(plan, stores, None)

    def _join(self, plan: dict[str, Any], stores: list[Any], state: dict[str, Any] | None) -> Resized:
        """Start the grown world of ``plan`` and move layers onto its new stages (collective over it)."""
        host = self._host
        assert host.lightning_module is not None
        environment, view = self._elastic.join(plan, stores, **self._world_args())
        if state is not None:
            elastic.restore_trainer_state(host.lightning_module.trainer, state)
        padded = StagePlan(tuple(plan["padded"]), view.world_size, host.schedule)
        own = self._adopt(environment, view, ReplicaLayout.even(view.world_size, 1), stores, plan["ports"], padded)
        with self._heartbeats.phase(f"growth onto {view.world_size} ranks (layer migration)"):
            grown = StagePlan(tuple(plan["plan"]), view.world_size, host.schedule)
            stats = own.stages.migrate(grown, host.optimizers)
        return Resized(stats, {"step": plan["step"], "layers_per_stage": plan["plan"]})

    def _world_args(self) -> dict[str, Any]:
        """What starting (or leaving) a world needs: the current environment, backend, timeout and this device."""
        host = self._host
        backend = host.process_group_backend or "gloo"
        return {"environment": host.cluster_environment, "backend": backend, "timeout": self._timeout,
                "device": host.root_device}  # fmt: skip

    def _adopt(
        self,
        environment: ClusterEnvironment,
        view: groups.WorldView,
        layout: ReplicaLayout,
        stores: list[Any],
        ports: list[int],
        plan: StagePlan,
    ) -> ResizeInternals:
        """Run ``plan`` (layers in place) with ``layout`` in the new world of ``environment``; the internals there."""
        host = self._host
        self._enter(layout, environment, view.num_nodes)  # the strategy moves into the new world and its groups
        self._heartbeats.start(environment, stores, ports)
        own = self._internals()  # the new world's groups
        own.stages.adopt(plan, own.mesh.pipeline, host.optimizers)
        return own
