"""The worlds the strategy runs in: the first, each one a shrink or a grow starts, and the end.

:class:`Resizer` carries out the pipeline's ``shrink`` and ``grow`` (consolidating onto fewer processes, re-admitting
them; ``strategy.pipeline_control`` asks it) and keeps who is in the job from one world to the next
(:class:`~dynmo_lightning.pipeline.elastic.members.ElasticWorld`). It is a collaborator of the strategy, not a part of
it: it reads the strategy through :class:`ResizeHost` (nothing more), changes the strategy's
:class:`~dynmo_lightning.pipeline.topology.world.World` in place (its environment, nodes, process groups and
heartbeats: ``World.adopt``), moves the layers of the stages it is handed, and never writes into the strategy: a shrink
or grow returns a :class:`Resized` outcome whose partition the handle records (one writer of the partition history).
It orchestrates the rooms that do the work: the layer moves
(:class:`~dynmo_lightning.pipeline.stage.local.LocalStages`), the new layout
(:mod:`~dynmo_lightning.pipeline.topology.ranks`), the world's restart and everyone's view of it
(:mod:`~dynmo_lightning.pipeline.elastic.members`, :mod:`~dynmo_lightning.pipeline.elastic.survivors`) and telling the
job manager (:mod:`~dynmo_lightning.pipeline.elastic.release`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from torch.optim import Optimizer

from dynmo_lightning import balance
from dynmo_lightning.pipeline.elastic import members as elastic
from dynmo_lightning.pipeline.elastic import release
from dynmo_lightning.pipeline.elastic import survivors as groups
from dynmo_lightning.pipeline.elastic.lost import InPlace, Survivors, plan_survivors
from dynmo_lightning.pipeline.elastic.members import ElasticWorld
from dynmo_lightning.pipeline.elastic.mirror import entries, holds_parts
from dynmo_lightning.pipeline.stage.local import LocalStages
from dynmo_lightning.pipeline.stage.migration import MigrationStats
from dynmo_lightning.pipeline.stage.reshape import MissingParts
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.pipeline.topology.heartbeats import PeerLostError
from dynmo_lightning.pipeline.topology.pending import end_default_group
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout
from dynmo_lightning.pipeline.topology.world import World

log = logging.getLogger(__name__)


class ResizeHost(Protocol):
    """The strategy as a resize reads it, and nothing else (the house test holds this list to what resize.py uses).

    Where the job's processes are is not here: that is the :class:`World` a resize changes in place.

    Attributes:
        process_group_backend: the backend of a new world (``None``: gloo).
        n_microbatches: micro-batches per step (a regrouped layout splits the batch into them).
        schedule: the pipeline schedule (the stage plans of a new world).
        stages_per_rank: stages every pipeline rank runs.
    """

    process_group_backend: str | None
    n_microbatches: int
    schedule: str
    stages_per_rank: int

    @property
    def lightning_module(self) -> pl.LightningModule | None:
        """Its trainer: the step, the callbacks told of a release, the loops a re-admitted process continues."""

    @property
    def optimizers(self) -> list[Optimizer]:
        """Moved layers take their optimizer state along (edited in place)."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every process (host data over the job's CPU group)."""


@dataclass(frozen=True)
class Resized:
    """What a shrink or grow did, for the strategy to record.

    Attributes:
        stats: the layer moves it made (with a shrink's copies).
        partition: ``{"step", "layers_per_stage"}`` of the new world: the strategy appends it to its history.
    """

    stats: MigrationStats
    partition: dict[str, Any]


class Resizer:
    """The worlds of a strategy: started, shrunk, grown and ended, the :class:`World` changed in place.

    Args:
        host: what a resize reads of the strategy (:class:`ResizeHost`); it never writes into it.
        world: the job's world (layout, groups, environment, heartbeats); every world has its own heartbeats,
            stopped and started here with it.
    """

    def __init__(self, host: ResizeHost, world: World) -> None:
        self._host, self._world = host, world
        #: The job's processes across restarts of the world: their nodes, stable ids, who waits to come back.
        self._elastic = ElasticWorld()
        #: Recovery without restart (``strategy.on_peer_lost="recover"``); ``None``: a lost process ends the job.
        self.in_place: InPlace | None = None

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a shrink (ranks, hosts, whole nodes freed)."""
        return self._elastic.releases

    def pipeline_nodes(self, layout: ReplicaLayout) -> list[Any]:
        """The node of every pipeline rank of ``layout`` (with replicas: the tuple of their nodes)."""
        return self._elastic.pipeline_nodes(layout)

    def start(self, node_rank: int) -> None:
        """Run in the first world: the even layout, every process's node, the heartbeats (collective)."""
        world = self._world
        environment = world.environment
        assert environment is not None
        world.adopt(ReplicaLayout.even(world.size, world.data_parallel_size, world.tensor_parallel_size))
        self._elastic.start(node_rank)
        self._start_heartbeats(environment, *groups.host_stores(1, environment.main_address, world.timeout))

    def _start_heartbeats(self, environment: ClusterEnvironment, stores: list[Any], ports: list[int]) -> None:
        """This world's heartbeats: in rank 0's store, or, recovering without restart, in the job manager's."""
        in_place, heartbeats = self.in_place, self._world.heartbeats
        if in_place is None:
            heartbeats.start(environment, stores, ports)
            return
        in_place.start(self._host.broadcast)
        heartbeats.start(environment, stores, ports, outside=in_place.heartbeat_store(), on_lost=in_place.on_lost)

    def recover(self, stages: LocalStages, lost: list[int]) -> Survivors:
        """Go on without the ``lost`` processes: the intact replicas' processes start a new world (see ``lost.py``).

        Called by every survivor once a distributed call failed on a lost peer (the broken world's groups are
        abandoned by then). A process of a broken replica ends here (status 0: its stage is incomplete, the intact
        replicas take over its data); the others return the new world's plan, its layout adopted and the layers in
        place.

        Raises:
            PeerLostError: the loss cannot be survived in place (no intact replica).
        """
        world, in_place = self._world, self.in_place
        assert in_place is not None and world.layout is not None and world.environment is not None
        started = time.monotonic()
        agreed = in_place.agree(lost)
        lps, empty = list(stages.plan.layers_per_stage), []
        if stages.packed is not None:  # a consolidation committed its moves before the loss: its kept ranks go on
            keep, lps = stages.packed
            empty = [p for p in range(world.layout.pp_size) if p not in keep]
        plan = plan_survivors(world.layout, agreed, empty, in_place.shards)
        in_place.shards = plan.shards
        world.heartbeats.stop()
        # the interrupted step may have left units gathered (their modules holding whole, plain parameters)
        stages.sharding.reshard([stages.module])
        # FSDP2: the lost shards' copies (of the broken world's tensors: asked for before the world ends)
        copies = in_place.mirror.copies(entries(stages.slots, self._host.optimizers), in_place.world)
        me, step = world.rank, self._host.lightning_module.trainer.global_step
        end_default_group()
        if me not in plan.members:
            log.warning("rank %d leaves: rank %s of its replica was lost; the intact replicas go on", me, agreed)
            groups.end_process()
        args = self._world_args()
        kwargs = {"device_id": args["device"]} if args["device"].type == "cuda" else {}
        origins = self._elastic.origins  # start-up ranks, the processes' stable ids (for the record)
        record = {"step": step, "lost": [origins[r] for r in agreed], "members": [origins[r] for r in plan.members],
                  "ranks_lost": agreed}  # fmt: skip
        in_place.rejoin(plan.members.index(me), len(plan.members), args["backend"], kwargs)
        environment, view = self._elastic.regroup(plan.members, me, args["environment"], in_place.port)
        world.adopt(plan.layout, environment, view.num_nodes)
        self._start_heartbeats(environment, [None], [in_place.port])
        kept = StagePlan(tuple(lps), world.pp_size, self._host.schedule)
        try:
            stages.adopt(kept, world.pipeline, self._host.optimizers, copies)
        except MissingParts as missing:  # no copy of a lost shard (layers changed since the last exchange)
            raise PeerLostError(f"rank {agreed} was lost and cannot be made up for in place: {missing}", []) from None
        in_place.recoveries.append({**record, "seconds": time.monotonic() - started})
        return plan

    def end(self) -> None:
        """Training ended: the heartbeats stop, and processes released with ``on_release="wait"`` may exit."""
        self._world.heartbeats.stop()
        self._elastic.end()

    @property
    def waiting(self) -> int:
        """Released processes a :meth:`grow` may re-admit now (one pipeline, one stage per rank only)."""
        world = self._world
        single = world.dp_size == 1 and self._host.stages_per_rank == 1 and world.pp_size >= 2
        return len(self._elastic.waiting) if single else 0

    def shrink(
        self,
        stages: LocalStages,
        keep_ranks: list[int],
        layers_per_stage: list[int],
        *,
        batch_size: int | None = None,
        on_release: str = "exit",
        release_to: release.ReleaseHandler | None = None,
    ) -> Resized:
        """Consolidate every pipeline replica onto pipeline ranks ``keep_ranks``; release the others (collective).

        Layers move onto the kept ranks with their state; the survivors start a new world and agree on it (see
        :mod:`~dynmo_lightning.pipeline.elastic.members`). Released processes end with status 0 (``on_release="exit"``),
        wait to be called back by :meth:`grow` or the end of training (``"wait"``), or, with ``"data_parallel"``, those
        that make whole pipelines become replicas that split their source replica's batches.

        Args:
            stages: this process's stages; layers move through them (packed, migrated, run in the new world).
            keep_ranks: current pipeline ranks that keep running, ascending, starting with 0 (never released).
            layers_per_stage: the partition over the kept ranks.
            batch_size: the last training step's batch size (rank 0's is what every process splits).
            on_release: ``"exit"``, ``"wait"`` or ``"data_parallel"``.
            release_to: told of the release by rank 0 of the new world (e.g. to shrink the Slurm allocation); the
                environment it returns is applied on every survivor. Its failure is logged, never raised.
        """
        host, world = self._host, self._world
        assert world.environment is not None and world.layout is not None and world.mesh is not None
        assert host.lightning_module is not None
        groups.check_shrink(keep_ranks, on_release, host.stages_per_rank)
        lps = balance.validate_partition(layers_per_stage, stages.slots.n_layers, len(keep_ranks))
        # Every process must derive the same new layout: agree on the batch size it splits first.
        batch_size = host.broadcast(batch_size)
        layout, copies = world.layout.regroup(keep_ranks, on_release, batch_size, host.n_microbatches)
        # Rank 0 opens the new world's stores now, on ports no other process can take before they are used.
        stores, ports = groups.host_stores(3, world.environment.main_address, world.timeout)
        with world.phase(f"consolidation onto pipeline ranks {keep_ranks} (layer migration and copies)"):
            # where shards have copies on replica peers, every pipeline commits its moves or none does
            job_wide = self.in_place is not None and holds_parts(entries(stages.slots, host.optimizers))
            stats = stages.pack(keep_ranks, lps, copies, host.optimizers, world.mesh.control, job_wide)
        with world.phase("consolidation (end of the old process group)"):
            dist.barrier()
        world.heartbeats.stop()  # the old world's heartbeats end with it (released processes fall silent on purpose)
        trainer, args = host.lightning_module.trainer, self._world_args()
        control = self._elastic.keep_control(stores[1], ports[1])
        if self.in_place is not None:  # released processes may wait on it: a recovery keeps its connections
            self.in_place.keep.add(control)
        if world.rank not in layout.order:
            call = self._elastic.leave(trainer, on_release, **args)
            return self._join(stages, call, [None, None], call.pop("state"))  # called back by a grow
        environment, view, event = self._elastic.survive(
            layout.order, stores, ports, trainer.global_step, on_release, **args
        )
        kept = StagePlan(tuple(lps), len(keep_ranks), host.schedule)
        self._adopt(stages, environment, view, layout.renumbered(), stores, ports, kept)
        if release_to is not None and event.released_ranks:
            env = release.notify(release_to, event) if world.rank == 0 else {}
            release.apply_environment(host.broadcast(env))
        return Resized(stats, {"step": trainer.global_step, "layers_per_stage": lps})

    def grow(self, stages: LocalStages, layers_per_stage: list[int]) -> Resized:
        """Re-admit released processes that wait, as new middle stages, and move layers onto them (collective).

        The same world restart as a shrink, in reverse; the called-back processes continue from the trainer's state
        at this step, and layers move with all their state, so the math does not change.

        Args:
            stages: this process's stages.
            layers_per_stage: the partition of the grown pipeline (at most ``waiting`` more stages than now).
        """
        host, world = self._host, self._world
        assert world.environment is not None and host.lightning_module is not None
        lps = balance.validate_partition(layers_per_stage, stages.slots.n_layers)
        if not self.waiting or len(lps) - world.pp_size > self.waiting:
            raise ValueError(f"cannot grow to {len(lps)} stages: {self.waiting} released processes wait to come back")
        trainer = host.lightning_module.trainer
        stores, ports = groups.host_stores(2, world.environment.main_address, world.timeout)
        plan = self._elastic.call_plan(lps, list(stages.plan.layers_per_stage), ports, trainer.global_step)
        state = elastic.capture_trainer_state(trainer)  # on every process: callbacks' state_dict may be collective
        if world.rank == 0:
            self._elastic.call_back(plan, state)
        with world.phase("growth (end of the old process group)"):
            dist.barrier()
        world.heartbeats.stop()
        end_default_group()
        return self._join(stages, plan, stores, None)

    def _join(
        self, stages: LocalStages, plan: dict[str, Any], stores: list[Any], state: dict[str, Any] | None
    ) -> Resized:
        """Start the grown world of ``plan`` and move layers onto its new stages (collective over it)."""
        host, world = self._host, self._world
        assert host.lightning_module is not None
        environment, view = self._elastic.join(plan, stores, **self._world_args())
        if state is not None:
            elastic.restore_trainer_state(host.lightning_module.trainer, state)
        padded = StagePlan(tuple(plan["padded"]), view.world_size, host.schedule)
        layout = ReplicaLayout.even(view.world_size, 1)
        self._adopt(stages, environment, view, layout, stores, plan["ports"], padded)
        with world.phase(f"growth onto {view.world_size} ranks (layer migration)"):
            grown = StagePlan(tuple(plan["plan"]), view.world_size, host.schedule)
            stats = stages.migrate(grown, host.optimizers)
        return Resized(stats, {"step": plan["step"], "layers_per_stage": plan["plan"]})

    def _world_args(self) -> dict[str, Any]:
        """What starting (or leaving) a world needs: the current environment, backend, timeout and this device."""
        world = self._world
        backend = self._host.process_group_backend or "gloo"
        return {"environment": world.environment, "backend": backend, "timeout": world.timeout,
                "device": world.device}  # fmt: skip

    def _adopt(
        self,
        stages: LocalStages,
        environment: ClusterEnvironment,
        view: groups.WorldView,
        layout: ReplicaLayout,
        stores: list[Any],
        ports: list[int],
        plan: StagePlan,
    ) -> None:
        """Run ``plan`` (layers in place) with ``layout`` in the new world of ``environment``."""
        world = self._world
        world.adopt(layout, environment, view.num_nodes)  # the world's groups, environment and nodes, in place
        self._start_heartbeats(environment, stores, ports)
        stages.adopt(plan, world.pipeline, self._host.optimizers)
