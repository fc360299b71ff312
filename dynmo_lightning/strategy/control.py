"""The pipeline's roles for callbacks (:mod:`dynmo_lightning.core.control`), answered for ``DynMoStrategy``.

``DynMoStrategy`` is Lightning's face: its hooks, steps, checkpoints and collectives. What callbacks ask of the
pipeline (its shape and history, layer events, rebalancing, layer editing) is :class:`PipelineHandle`, which the
strategy gives as ``strategy.pipeline_control`` and which holds the stages this process runs, the partition history
and the resizer; the world both read is the strategy's one :class:`~dynmo_lightning.pipeline.topology.world.World`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collections
from torch import Tensor
from torch.optim import Optimizer

from dynmo_lightning import balance
from dynmo_lightning.balance.diffusion.driver import DiffusionStage
from dynmo_lightning.pipeline.elastic import release
from dynmo_lightning.pipeline.elastic.mirror import entries, holds_parts
from dynmo_lightning.pipeline.elastic.resize import Resized, ResizeHost, Resizer
from dynmo_lightning.pipeline.stage.local import LayerEditor, LocalStages
from dynmo_lightning.pipeline.stage.migration import MigrationStats
from dynmo_lightning.pipeline.stage.neighbours import NeighbourStats, run_stage
from dynmo_lightning.pipeline.stage.reduce import replicas_in_sync
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.pipeline.topology.data import TakenShards
from dynmo_lightning.pipeline.topology.heartbeats import PeerLostError
from dynmo_lightning.pipeline.topology.world import World
from dynmo_lightning.profiling import DeviceClock


class HandleHost(ResizeHost, Protocol):
    """The strategy as the handle reads it (and a resize through it): its settings, module, optimizers, broadcast."""

    data_parallel: str
    tensor_parallel_size: int
    fsdp_memory: str

    @property
    def world_size(self) -> int:
        """Processes of the job."""

    @property
    def lightning_module(self) -> pl.LightningModule | None:
        """Its trainer's step."""

    @property
    def optimizers(self) -> list[Optimizer]:
        """Moved layers take their optimizer state along; the first one's state is profiled."""


class Forwarded:
    """An attribute of another object its owner holds, read and set there: ``pp_size = Forwarded("world")``.

    Args:
        holder: the owner's attribute holding the object.
        name: the attribute there (``None``: the same name as here).
    """

    def __init__(self, holder: str, name: str | None = None) -> None:
        self.holder, self.name = holder, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.holder), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.holder), self.name, value)


class PipelineHandle:
    """Every role of :class:`~dynmo_lightning.core.control.PipelineControl`, and :class:`LayerEditing`'s maker.

    Args:
        strategy: the strategy it answers for (its settings, optimizers, module and collectives).
        world: the strategy's world.
    """

    def __init__(self, strategy: HandleHost, world: World) -> None:
        self._strategy, self.world = strategy, world
        #: The stages this process runs (``None`` before the model is split in set-up).
        self.stages: LocalStages | None = None
        #: ``[{"step", "layers_per_stage"}]``: the initial partition and every change.
        self.partitions: list[dict[str, Any]] = []
        #: The worlds it runs in, shrinks, grows (pipeline/elastic/resize.py).
        self.resizer = Resizer(strategy, world)
        #: The last training step's schedule: its clock, start and end.
        self.schedule_span: tuple[DeviceClock, Any, Any] | None = None
        #: Batch size the sampler delivered in the last training step (before a replica takes its part).
        self.batch_size: int | None = None
        #: The data shards of lost replicas this replica trains on too (after a recovery without restart).
        self.taken: TakenShards | None = None

    # --- recovery without restart (pipeline/elastic/lost.py) --------------------------------------------------------
    def recover(self, error: PeerLostError) -> None:
        """Go on without the lost process of ``error`` (every survivor; re-raised where it cannot be survived).

        The survivors' world is formed and adopted and this replica takes over its share of the lost replicas' data;
        the caller runs the step again from its beginning (its gradients start from none, as every step's do).
        """
        module = self._strategy.lightning_module
        if self.resizer.in_place is None or not error.lost or module is None:
            raise error
        survivors = self.resizer.recover(self.local, error.lost)
        replica = self.world.dp_rank
        taken = survivors.shards[replica][1:]
        self.taken = TakenShards(module.trainer.train_dataloader, taken) if taken else None
        self.local.runtime.loss_fn = weighted(module.pipeline_loss, survivors.weight(replica))
        # the new world's shards, before the step runs again
        self._exchange_copies(module.trainer.global_step, self.copied_state())

    def surviving(self, call: Callable[[], Any]) -> Any:
        """``call()``; recovering without restart, once more on the survivors' world if a process was lost in it."""
        while True:
            try:
                return call()
            except PeerLostError as lost:
                self.recover(lost)

    def with_taken_shards(self, batch: Any) -> Any:
        """``batch`` and, after a recovery, the same step's batches of the data shards this replica took over."""
        if self.taken is None or self._strategy.lightning_module is None:
            return batch
        trainer = self._strategy.lightning_module.trainer
        for extra in self.taken.batches(trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx):
            extra = self._strategy.batch_to_device(extra)
            batch = apply_to_collections(batch, extra, Tensor, lambda a, b: torch.cat([a, b]))
        return batch

    def committed(self, closure: Callable[[], Any]) -> Any:
        """Run a step's ``closure`` until every process finished the step; the optimizer applies it afterwards.

        A process lost before every process voted (:meth:`~dynmo_lightning.pipeline.elastic.lost.InPlace.commit`)
        means nobody applies the step: the survivors recover and run it again.
        """
        in_place = self.resizer.in_place
        assert in_place is not None and self._strategy.lightning_module is not None
        step = self._strategy.lightning_module.trainer.global_step
        while True:
            result = closure()
            try:
                with self.world.phase(f"training step {step} (commit of the optimizer step)"):
                    in_place.commit(step, self.world.size)
                return result
            except PeerLostError as lost:
                self.recover(lost)

    def mirrored(self, apply: Callable[[], Any]) -> Any:
        """Apply an optimizer step (``apply``: closure, commit, update) so that a loss at any point can be survived.

        Under FSDP2 the processes then exchange their new shards' copies (``pipeline/elastic/mirror.py``); a loss
        before every process holds its predecessor's puts each survivor's own shards back as they were before the
        step, the survivors recover from the copies of the same state, and the step runs again.
        """
        in_place = self.resizer.in_place
        assert in_place is not None and self._strategy.lightning_module is not None
        step = self._strategy.lightning_module.trainer.global_step
        while True:
            result = apply()
            held = self.copied_state()
            try:
                self._exchange_copies(step, held, after_update=True)
                return result
            except PeerLostError as lost:
                in_place.mirror.restore(held, in_place.world)
                self.recover(lost)

    def keep_copies(self) -> None:
        """Before a training step: copies of the shards as they are now, where layers changed since the last."""
        in_place = self.resizer.in_place
        if in_place is None or self._strategy.lightning_module is None:
            return
        held = self.copied_state()
        if not in_place.mirror.current(held, in_place.world):
            self._exchange_copies(self._strategy.lightning_module.trainer.global_step, held)

    def copied_state(self) -> list[Tensor]:
        """The tensors of this process's layers' state that the copies are of (``mirror.entries``)."""
        return entries(self.local.slots, self._strategy.optimizers)

    def _exchange_copies(self, step: int, held: list[Tensor], after_update: bool = False) -> None:
        """Exchange the copies of ``held`` (:meth:`copied_state`) over each stage's replica group (collective over it).

        ``after_update``: of a step just applied; the copies are in force once every process of the job voted that it
        holds its predecessor's (a loss before that rolls every survivor back). Otherwise of the state as it is (the
        layers changed between steps, or a new world): in force once this process holds its predecessor's, as the
        state did not change; a peer's copies that are not in force are not offered after a loss.
        """
        in_place = self.resizer.in_place
        if in_place is None or self.world.dp_size < 2 or not holds_parts(held):
            return  # no loss to survive (one replica), or nothing to copy (ddp / replicate hold stages whole)
        with self.world.phase(f"training step {step} (copies of the shards on the replica peers)"):
            in_place.mirror.exchange(held, self.local.sharding.mesh().get_group(), in_place.world)
            if after_update:
                in_place.commit(step, self.world.size, "held")
        in_place.mirror.promote()

    # --- the strategy's settings and the world's facts, as the roles read them (docs: core/control.py) ----------
    n_microbatches = Forwarded("_strategy")
    schedule = Forwarded("_strategy")
    stages_per_rank = Forwarded("_strategy")
    data_parallel = Forwarded("_strategy")
    tensor_parallel_size = Forwarded("_strategy")
    fsdp_memory = Forwarded("_strategy")
    world_size = Forwarded("_strategy")
    pp_size = Forwarded("world")
    pp_rank = Forwarded("world")
    dp_size = Forwarded("world")
    dp_rank = Forwarded("world")
    replica_ranks = Forwarded("world")
    host_group = Forwarded("world")
    device_mesh = Forwarded("world")

    # --- run facts ---------------------------------------------------------------------------------------------------
    @property
    def local(self) -> LocalStages:
        """The stages this process runs (after set-up)."""
        if self.stages is None:
            raise RuntimeError("the model is split into stages in the strategy's set-up (Trainer.fit)")
        return self.stages

    @property
    def n_layers(self) -> int:
        """Number of pipeline layers of the model (0 before the model is split)."""
        return self.stages.slots.n_layers if self.stages is not None else 0

    @property
    def n_stages(self) -> int:
        """Number of (virtual) pipeline stages."""
        return self.world.pp_size * self.stages_per_rank

    @property
    def layers_per_stage(self) -> list[int]:
        """The current partition (empty before the model is split)."""
        return list(self.stages.plan.layers_per_stage) if self.stages is not None else []

    @property
    def layer_param_counts(self) -> list[int]:
        """Parameter count of every pipeline layer (taken before the split)."""
        return list(self.stages.split.param_counts) if self.stages is not None else []

    @property
    def schedule_seconds(self) -> float:
        """Device time of the last training step's schedule (all micro-batches; on GPU reading waits for them)."""
        return self.schedule_span[0].elapsed(*self.schedule_span[1:]) if self.schedule_span else 0.0

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a shrink (ranks, hosts, whole nodes freed)."""
        return self.resizer.releases

    def param_norm(self) -> float:
        """L2 norm (float64) of all parameters of the unsplit model, across stages; tied ones counted once."""
        return self.local.param_norm(self._part_groups(), self.world.holders)

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds bit-identical parameters and persistent buffers (collective over the job)."""
        module, mesh = self._strategy.lightning_module, self.world.mesh
        assert module is not None and mesh is not None
        return replicas_in_sync(module.state_dict(), mesh.dp_control, self.world.dp_size, self.world.pipeline.device)

    # --- layer events ------------------------------------------------------------------------------------------------
    def on_layers_changed(self, layers: list[int] | None = None) -> None:
        """Rebuild stages and schedules (their boundaries' gradients may have changed) before the next step."""
        if self.stages is not None:
            self.stages.layers_changed(self._step(), layers)

    def changed_layers(self, step: int) -> list[int]:
        """The layers reported changed while ``step`` optimizer steps were done (the balancer reacts to them)."""
        return self.stages.changed_layers(step) if self.stages is not None else []

    def tie_layers(self, param: Tensor) -> set[int]:
        """Indices of all pipeline layers sharing ``param`` (a local parameter) in the unsplit model; empty if none."""
        return self.stages.tie_layers(param) if self.stages is not None else set()

    def shard_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the processes holding other parts of this stage's layers (collective over them).

        FSDP2's replicas and the tensor-parallel group; each process weighs its parts by ``reduce.held_share``.
        """
        for group in self._part_groups():
            dist.all_reduce(values := values.clone(), op=dist.ReduceOp.SUM, group=group)
        return values

    def layer_editing(self) -> LayerEditor | None:
        """The role of callbacks that change layers' shapes (``LayerEditing``; ``pipeline/stage/reshape.py``).

        ``None`` before the model is split: there are no layers held in parts to edit yet.
        """
        if self.stages is None:
            return None
        return LayerEditor(self.stages, self._strategy.optimizers, self.tensor_parallel_size)

    def _part_groups(self) -> list[dist.ProcessGroup]:
        return self.world.part_groups(self.data_parallel == "fsdp")

    # --- rebalancing -------------------------------------------------------------------------------------------------
    def request_profile(self) -> None:
        """Profile the coming training step (callbacks call this in ``on_train_batch_start``; several may)."""
        self.local.request_profile()

    def profile_results(self) -> dict[int, dict[str, float]] | None:
        """Every layer's measured costs of the step just profiled (collective), or ``None`` if it was not profiled."""
        mesh, optimizers = self.world.mesh, self._strategy.optimizers
        assert mesh is not None
        rows = len(mesh.layout.replicas)  # every pipeline plans from the same numbers
        replicas = (mesh.stage_control or mesh.dp_control, rows) if rows > 1 else None
        return self.local.profile_results(optimizers[0] if optimizers else None, replicas)

    def repartition(self, layers_per_stage: list[int]) -> MigrationStats:
        """Move layers (with all their state) so that the pipeline runs ``layers_per_stage``; the math never changes.

        Every process must call it with the same plan; stages, schedule and optimizer groups are rebuilt.
        """
        lps = balance.validate_partition(layers_per_stage, self.n_layers, self.n_stages)
        new = StagePlan(tuple(lps), self.world.pp_size, self.schedule)
        if new == self.local.plan:
            return MigrationStats(moves=[])
        assert self.world.mesh is not None
        try:
            with self.world.phase(f"layer migration {self.layers_per_stage} -> {lps}"):
                stats = self.local.migrate(new, self._strategy.optimizers, self.world.mesh.control, self._job_wide())
        except PeerLostError as lost:
            return self._survive(lost)
        return self._record(Resized(stats, {"step": self._step(), "layers_per_stage": lps}))

    @property
    def fsdp_memory_in_force(self) -> str:
        """How FSDP2 units hold a step's weights and gradients now: ``"fast"`` or ``"lean"``."""
        lean = self.stages.sharding.lean if self.stages is not None else self.fsdp_memory == "lean"
        return "lean" if lean else "fast"

    def set_fsdp_memory(self, way: str) -> None:
        """Hold FSDP2 units' weights and gradients ``way`` (``"fast"``, ``"lean"``) from the next step on."""
        self.local.set_lean(way == "lean")

    def run_neighbours(self, stage_of: Callable[[int], DiffusionStage]) -> NeighbourStats:
        """Drive this process's stage ``stage_of(pp_rank)`` of the diffusion protocol, point-to-point to neighbours."""
        with self.world.phase("diffusion balancing between pipeline neighbours"):
            return run_stage(stage_of(self.world.pp_rank), self.world.pipeline)

    @property
    def pipeline_nodes(self) -> list[Any] | None:
        """The node of every pipeline rank (with replicas: the tuple of their nodes), for a repack that frees nodes."""
        return self.resizer.pipeline_nodes(self.world.layout) if self.world.layout else None

    @property
    def waiting(self) -> int:
        """Released processes waiting to be re-admitted by :meth:`grow` (one pipeline, one stage per rank only)."""
        return self.resizer.waiting

    def shrink(self, keep_ranks: list[int], layers_per_stage: list[int], *, on_release: str = "exit",
               release_to: release.ReleaseHandler | None = None) -> MigrationStats:  # fmt: skip
        """Consolidate onto pipeline ranks ``keep_ranks``, release the others (collective; :meth:`Resizer.shrink`)."""
        try:
            resized = self.resizer.shrink(self.local, keep_ranks, layers_per_stage, batch_size=self.batch_size,
                                          on_release=on_release, release_to=release_to)  # fmt: skip
        except PeerLostError as lost:
            return self._survive(lost)
        return self._record(resized)

    def grow(self, layers_per_stage: list[int]) -> MigrationStats:
        """Re-admit waiting processes as new stages of ``layers_per_stage`` (collective; :meth:`Resizer.grow`)."""
        return self._record(self.resizer.grow(self.local, layers_per_stage))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Global rank ``src``'s ``obj`` on every process (collective; the strategy's broadcast)."""
        return self._strategy.broadcast(obj, src)

    def _step(self) -> int:
        module = self._strategy.lightning_module
        return module.trainer.global_step if module is not None else -1

    def _job_wide(self) -> bool:
        """Whether a migration commits in every pipeline or none: where FSDP2's shards have copies.

        A move that commits in one replica and not in another would leave a moved layer's copies on processes that
        no longer hold it.
        """
        return self.resizer.in_place is not None and holds_parts(self.copied_state())

    def _survive(self, lost: PeerLostError) -> MigrationStats:
        """A process was lost during a migration or a consolidation: the survivors go on (or ``lost`` is raised).

        Both are two-phase (every transfer done and agreed before anything is committed): each surviving pipeline
        holds its old partition or, where its agreement completed, the new one, every layer once. The survivors run
        the partition their stages hold; the balancer plans again from it.
        """
        self.recover(lost)
        lps = self.layers_per_stage
        if not self.partitions or self.partitions[-1]["layers_per_stage"] != lps:
            self.partitions.append({"step": self._step(), "layers_per_stage": lps})
        return MigrationStats(moves=[])

    def _record(self, resized: Resized) -> MigrationStats:
        self.partitions.append(resized.partition)  # the handle alone writes the partition history
        return resized.stats


def weighted(loss_fn: Callable[[Any, Tensor], Tensor], weight: float) -> Callable[[Any, Tensor], Tensor]:
    """``loss_fn`` times ``weight`` (``loss_fn`` itself for 1: a replica training on its share of the batch)."""
    if weight == 1:
        return loss_fn
    return lambda output, target: loss_fn(output, target) * weight
