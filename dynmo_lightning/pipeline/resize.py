"""The strategy's shrink and grow: consolidating onto fewer processes and re-admitting them, as a mixin.

:class:`ResizeMixin` is the part of :class:`~dynmo_lightning.DynMoStrategy` that changes the world's size; it
orchestrates the rooms that do the work: the layer moves (:class:`~dynmo_lightning.pipeline.stages.LocalStages`),
the new layout (:mod:`~dynmo_lightning.pipeline.layout`), the world's restart and everyone's view of it
(:mod:`~dynmo_lightning.pipeline.elastic`, :mod:`~dynmo_lightning.pipeline.groups`) and telling the job manager
(:mod:`~dynmo_lightning.pipeline.release`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from dynmo_lightning import balance
from dynmo_lightning.pipeline import elastic, groups, release
from dynmo_lightning.pipeline.elastic import ElasticWorld
from dynmo_lightning.pipeline.layout import Mesh, ReplicaLayout
from dynmo_lightning.pipeline.migration import MigrationStats
from dynmo_lightning.pipeline.runtime import StagePlan


class ResizeMixin:
    """Shrink and grow for :class:`~dynmo_lightning.DynMoStrategy` (which provides every attribute used here)."""

    elastic: ElasticWorld
    _timeout: timedelta
    _process_group_backend: str | None
    _batch_size: int | None
    partitions: list[dict[str, Any]]
    num_nodes: int
    schedule: str
    _mesh: Mesh | None

    @property
    def pipeline_nodes(self) -> list[Any] | None:
        """The node of every pipeline rank (with replicas: the tuple of their nodes), for a repack that frees nodes."""
        return self.elastic.pipeline_nodes(self._layout) if self._layout else None

    @property
    def waiting(self) -> int:
        """Released processes waiting to be re-admitted by :meth:`grow` (one pipeline, one stage per rank only)."""
        single = self.dp_size == 1 and self.stages_per_rank == 1 and self.pp_size >= 2
        return len(self.elastic.waiting) if single else 0

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a shrink (ranks, hosts, whole nodes freed)."""
        return self.elastic.releases

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
        assert self._stages and self._layout and self._mesh and self.cluster_environment and self.lightning_module
        groups.check_shrink(keep_ranks, on_release, self.stages_per_rank)
        lps = balance.validate_partition(layers_per_stage, self.n_layers, len(keep_ranks))
        # Every process must derive the same new layout: agree on the batch size it splits first.
        self._batch_size = self.broadcast(self._batch_size)
        layout, copies = self._layout.regroup(keep_ranks, on_release, self._batch_size, self.n_microbatches)
        # Rank 0 opens the new world's stores now, on ports no other process can take before they are used.
        stores, ports = groups.host_stores(3, self.cluster_environment.main_address, self._timeout)
        with self._phase(f"consolidation onto pipeline ranks {keep_ranks} (layer migration and copies)"):
            stats = self._stages.pack(keep_ranks, lps, copies, self.optimizers, self._mesh.control)
        with self._phase("consolidation (end of the old process group)"):
            dist.barrier()
        self._stop_watchdog()  # the old world's heartbeats end with it (released processes fall silent on purpose)
        trainer, world = self.lightning_module.trainer, self._world_args()
        self.elastic.keep_control(stores[1], ports[1])
        if self.global_rank not in layout.order:
            call = self.elastic.leave(trainer, on_release, **world)
            return self._join(call, [None, None], call.pop("state"))  # called back by a grow
        self.cluster_environment, view, event = self.elastic.survive(
            layout.order, stores, ports, trainer.global_step, on_release, **world
        )
        kept = StagePlan(tuple(lps), len(keep_ranks), self.schedule)
        self._adopt_world(view, layout.renumbered(), stores, ports, kept)
        self.partitions.append({"step": trainer.global_step, "layers_per_stage": lps})
        if release_to is not None and event.released_ranks:
            env = release.notify(release_to, event) if self.is_global_zero else {}
            release.apply_environment(self.broadcast(env))
        return stats

    def grow(self, layers_per_stage: list[int]) -> MigrationStats:
        """Re-admit released processes that wait, as new middle stages, and move layers onto them (collective).

        The same world restart as a shrink, in reverse; the called-back processes continue from the trainer's state
        at this step, and layers move with all their state, so the math does not change.

        Args:
            layers_per_stage: the partition of the grown pipeline (at most :attr:`waiting` more stages than now).
        """
        assert self._stages is not None and self.lightning_module is not None and self.cluster_environment
        lps = balance.validate_partition(layers_per_stage, self.n_layers)
        if not self.waiting or len(lps) - self.pp_size > self.waiting:
            raise ValueError(f"cannot grow to {len(lps)} stages: {self.waiting} released processes wait to come back")
        trainer = self.lightning_module.trainer
        stores, ports = groups.host_stores(2, self.cluster_environment.main_address, self._timeout)
        plan = self.elastic.call_plan(lps, self.layers_per_stage, ports, trainer.global_step)
        state = elastic.capture_trainer_state(trainer)  # on every process: callbacks' state_dict may be collective
        if self.is_global_zero:
            self.elastic.call_back(plan, state)
        with self._phase("growth (end of the old process group)"):
            dist.barrier()
        self._stop_watchdog()
        dist.destroy_process_group()
        return self._join(plan, stores, None)

    def _join(self, plan: dict[str, Any], stores: list[Any], state: dict[str, Any] | None) -> MigrationStats:
        """Start the grown world of ``plan`` and move layers onto its new stages (collective over it)."""
        assert self._stages is not None and self.lightning_module is not None
        self.cluster_environment, view = self.elastic.join(plan, stores, **self._world_args())
        if state is not None:
            elastic.restore_trainer_state(self.lightning_module.trainer, state)
        padded = StagePlan(tuple(plan["padded"]), view.world_size, self.schedule)
        self._adopt_world(view, ReplicaLayout.even(view.world_size, 1), stores, plan["ports"], padded)
        with self._phase(f"growth onto {view.world_size} ranks (layer migration)"):
            grown = StagePlan(tuple(plan["plan"]), view.world_size, self.schedule)
            stats = self._stages.migrate(grown, self.optimizers)
        self.partitions.append({"step": plan["step"], "layers_per_stage": plan["plan"]})
        return stats

    def _world_args(self) -> dict[str, Any]:
        backend = self._process_group_backend or "gloo"
        return {"environment": self.cluster_environment, "backend": backend, "timeout": self._timeout,
                "device": self.root_device}  # fmt: skip

    def _adopt_world(self, view: Any, layout: ReplicaLayout, stores: list[Any], ports: list[int], plan: StagePlan):
        """Run ``plan`` (layers in place) with ``layout`` in the new world of ``view``."""
        assert self._stages is not None
        self.num_nodes = view.num_nodes
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self._use_layout(layout)
        self._start_watchdog(stores, ports)
        self._stages.adopt(plan, self._pipe, self.optimizers)
