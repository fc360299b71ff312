"""DynMoStrategy: pipeline-parallel training of a pipeline-ready LightningModule across processes.

The Lightning face: the strategy's hooks and the orchestration of re-partitioning. Every other job is a collaborator
in its room under :mod:`dynmo_lightning.pipeline`: the stages this process runs (``stages``), the job's layout
(``layout``), reductions (``reduce``), the worlds it runs in with their shrinks and grows (``resize``), the
launcher's checks, the precision and checkpoint plugins, what evaluation logs (``evaluation``).

Lightning's closure calls ``training_step``, zeroes the gradients, then calls ``strategy.backward``; a schedule runs
forward *and* backward of all micro-batches at once, so ``training_step`` runs it and parks the gradients and
``backward`` puts them back. The rest is stock Lightning: hooks, clipping (by the global norm), optimizers, schedulers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities import distributed as fabric_dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import Self, override

from dynmo_lightning import balance, callbacks
from dynmo_lightning.balance.diffusion.driver import DiffusionStage
from dynmo_lightning.core.model import split_batch
from dynmo_lightning.pipeline import checkpoint as ckpt
from dynmo_lightning.pipeline import groups, launcher, release, sharded
from dynmo_lightning.pipeline.evaluation import PipelineEvaluation
from dynmo_lightning.pipeline.layout import Mesh, PipelineGroup, ReplicaLayout, check_batch, make_mesh, shard_dataloader
from dynmo_lightning.pipeline.migration import MigrationStats
from dynmo_lightning.pipeline.neighbours import NeighbourStats, run_stage
from dynmo_lightning.pipeline.plugins import WrappedPlugins
from dynmo_lightning.pipeline.reduce import GlobalNormClipping, replicas_in_sync
from dynmo_lightning.pipeline.resize import Resized, ResizeInternals, Resizer
from dynmo_lightning.pipeline.runtime import StagePlan, first_dim
from dynmo_lightning.pipeline.sharding import FSDP_MODES, StageSharding
from dynmo_lightning.pipeline.stages import LayerEditor, LocalStages
from dynmo_lightning.pipeline.strategy_settings import PLUGINS, StrategyArguments, StrategySettings
from dynmo_lightning.pipeline.tensor_parallel import TensorParallel
from dynmo_lightning.pipeline.watchdog import Heartbeats
from dynmo_lightning.profiling import DeviceClock, release_host_memory
from dynmo_lightning.recompute import checkpoint_policy
from dynmo_lightning.settings import build, configured_by, from_settings


class DynMoStrategy(WrappedPlugins):
    """Pipeline parallelism for pipeline-ready LightningModules (see :mod:`dynmo_lightning.protocol`).

    Each process holds one pipeline stage (or ``stages_per_rank`` interleaved stages): a contiguous run of the
    module's ``pipeline_layers()``; other stages' layers are dropped, and meta-device layers are materialised only
    where they live, each from its own seed. With ``data_parallel_size=D`` the ``W`` processes form a ``D x (W / D)``
    device mesh (:attr:`device_mesh`, ``("dp", "pp")``): ``D`` replicas of a pipeline on consecutive global ranks;
    data is sharded over replicas, gradients averaged over them, balancing decided once and applied in every replica.
    The strategy implements :class:`~dynmo_lightning.protocol.PipelineControl`, the contract callbacks use.

    Every setting is a field of :class:`~dynmo_lightning.pipeline.strategy_settings.StrategySettings` (its docstrings
    say what each does; one name and one default, shared with the Hydra group ``strategy``): give them as keyword
    arguments, ``DynMoStrategy(n_microbatches=8, schedule="zbv", stages_per_rank=2)``, or as one settings object,
    ``DynMoStrategy.from_settings(settings)``. ``accelerator``, ``parallel_devices``, ``cluster_environment`` (torchrun,
    SLURM, Lightning's own launcher), ``checkpoint_io`` (wrapped to write atomically) and ``precision_plugin`` (wrapped
    to clip by the norm over all stages) are set by the Trainer.
    """

    strategy_name = "dynmo"

    @configured_by(StrategyArguments)
    def __init__(self, **kwargs: Any) -> None:
        plugins = {name: kwargs.pop(name, None) for name in PLUGINS}
        super().__init__(**plugins)
        s = self.settings = build(StrategySettings, "DynMoStrategy", "strategy", kwargs)
        self.activation_checkpointing = s.activation_checkpointing
        self.n_microbatches, self.schedule, self.stages_per_rank = s.n_microbatches, s.schedule, s.stages_per_rank
        self.partition, self.data_parallel_size, self.data_parallel = s.partition, s.data_parallel_size, s.data_parallel
        self.tensor_parallel_size, self.fsdp_memory = s.tensor_parallel_size, s.fsdp_memory
        self._timeout, self.heartbeat_timeout = s.timeout_delta, float(s.heartbeat_timeout)
        self.checkpoint_format = s.checkpoint_format
        self.process_group_backend = s.process_group_backend  # resolved per device at start-up
        self.num_nodes = 1  # set by the Trainer
        self._layout: ReplicaLayout | None = None
        self._mesh: Mesh | None = None
        self._stages: LocalStages | None = None
        #: What evaluation steps log: loss, perplexity of token targets, the module's ``pipeline_eval_step``.
        self._evaluation = PipelineEvaluation(
            lambda: self._pipe, lambda: self._stages.runtime.has_last_stage, lambda: self._stages.runtime.last_rank
        )
        self._shard_data: bool | None = None  # the Trainer's use_distributed_sampler (the strategy shards itself)
        #: Batch size the sampler delivered in the last training step (before a replica takes its part).
        self._batch_size: int | None = None
        self._schedule_span: tuple[DeviceClock, Any, Any] | None = None  # the last training step's schedule
        #: ``[{"step", "layers_per_stage"}]``: the initial partition and every change.
        self.partitions: list[dict[str, Any]] = []
        # One set of heartbeats per world; its phases name what the job does (a lost peer's error names it).
        self._heartbeats = Heartbeats(self.heartbeat_timeout, self._global_step)
        self._phase = self._heartbeats.phase
        # The worlds it runs in, shrinks, grows (pipeline/resize.py): all they read or change here is an argument.
        self._resizer = Resizer(self, lambda: ResizeInternals(self._stages, self._layout, self._mesh, self._batch_size),
                                self._use_layout, self._heartbeats, self._timeout)  # fmt: skip
        self._device: torch.device | None = None  # pinned at start-up: a shrink renumbers local ranks, not devices

    @classmethod
    def from_settings(cls, settings: StrategySettings, **overrides: Any) -> Self:
        """The strategy of one settings object (``overrides`` replace some of its fields, or give plugins)."""
        return from_settings(cls, StrategySettings, settings, overrides)

    # --- processes, devices and plugins ------------------------------------------------------------------------------
    @property
    def schedule_seconds(self) -> float:
        """Device time of the last training step's schedule (all micro-batches; on GPU reading waits for them)."""
        return self._schedule_span[0].elapsed(*self._schedule_span[1:]) if self._schedule_span else 0.0

    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning then syncs logs and wraps dataloaders with a (pipeline-aware) sampler."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of one pipeline consume the same batch; the data is sharded over the replicas.
        shard, n_shards = self._layout.shards[self.dp_rank] if self._layout else (self.dp_rank, self.dp_size)
        return {"num_replicas": n_shards, "rank": shard}

    # --- the job's layout (pipeline/layout.py) -----------------------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp")`` ``DeviceMesh`` of the job (``("dp", "pp", "tp")`` under tensor parallelism)."""
        return self._mesh.device_mesh if self._mesh else None

    @property
    def pp_size(self) -> int:
        """Number of processes in the pipeline."""
        return self._layout.pp_size if self._layout else self.world_size // self._holders

    @property
    def pp_rank(self) -> int:
        """Rank of this process in the pipeline."""
        return self._layout.pp_rank(self.global_rank) if self._layout else self.global_rank % self.pp_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of the pipeline (grows when released processes form new ones)."""
        return self._layout.dp_size if self._layout else self.data_parallel_size

    @property
    def dp_rank(self) -> int:
        """Index of this process's replica."""
        return self._layout.dp_rank(self.global_rank) if self._layout else self.global_rank // self.pp_size

    @property
    def _holders(self) -> int:
        """Processes holding each stage: its replicas times its tensor-parallel processes."""
        return self.dp_size * self.tensor_parallel_size

    @property
    def host_group(self) -> Any:
        """The job's CPU (gloo) group for host data (``None``: the default group, which is gloo then)."""
        return self._mesh.control if self._mesh is not None else None

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank (the rows of :attr:`device_mesh`)."""
        return [list(ranks) for ranks in self._layout.replicas] if self._layout else []

    @property
    def n_stages(self) -> int:
        """Number of (virtual) pipeline stages."""
        return self.pp_size * self.stages_per_rank

    @property
    def _local(self) -> LocalStages:
        assert self._stages is not None, "the stages are built in setup"
        return self._stages

    @property
    def _pipe(self) -> PipelineGroup:
        assert self._mesh is not None
        return self._mesh.pipeline

    def _tie_layout(self) -> tuple[ReplicaLayout, int]:
        assert self._layout is not None
        return self._layout, self._layout.row(self.global_rank)

    def _use_layout(
        self, layout: ReplicaLayout, environment: ClusterEnvironment | None = None, num_nodes: int | None = None
    ) -> None:
        """Adopt ``layout`` here, or in the new world of ``environment`` (collective; the one place worlds change)."""
        if environment is not None:
            self.cluster_environment, self.num_nodes = environment, num_nodes or self.num_nodes
            rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        units = self.data_parallel in FSDP_MODES
        self._layout = layout
        self._mesh = make_mesh(layout, self.global_rank, self._timeout, self.root_device, unit_groups=units)
        if isinstance(clipping := getattr(self._precision_plugin, "clip_by_norm", None), GlobalNormClipping):
            clipping.holders = self._holders  # a stage's holders change with its replicas (a grown replica group)

    # --- start-up ----------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._launcher = launcher.PipelineLauncher(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        launcher.check_world(self.world_size, self.data_parallel_size, self.tensor_parallel_size)
        device = self.root_device
        backend = self.process_group_backend or fabric_dist._get_default_process_group_backend_for_device(device)
        self.process_group_backend = backend
        kwargs = {"device_id": device} if device.type != "cpu" else {}
        fabric_dist._init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, **kwargs)
        self._device = device
        self._resizer.start(self.node_rank)

    def set_world_ranks(self) -> None:
        """Derive global rank and world size from node rank, local rank and processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def connect(self, model: pl.LightningModule) -> None:
        launcher.check_model(model)
        super().connect(model)

    @override
    def model_sharded_context(self) -> Any:
        # Layers made in `configure_model` start on the meta device; each stage materialises only its own.
        return torch.device("meta")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        launcher.check_trainer(trainer, module, self.precision_plugin.inner)
        callbacks.use_pipeline_summaries(trainer.callbacks)  # Lightning's would describe this stage as the model
        # Lightning would give every training loader a shuffling sampler: `process_dataloader` keeps the user's order.
        connector = trainer._accelerator_connector
        if self._shard_data is None:
            self._shard_data = connector.use_distributed_sampler
        connector.use_distributed_sampler = self._shard_data and trainer.state.fn == TrainerFn.PREDICTING
        # Before the split: layers are built in their final dtype, and as parts where parts are what a process holds.
        self.precision_plugin.convert_module(module)
        if self._stages is None:
            tp = TensorParallel(module, lambda: self._mesh.tp_mesh) if self.tensor_parallel_size > 1 else None
            self._stages = LocalStages.from_module(
                module, self.partition, self._pipe, self._tie_layout, stages_per_rank=self.stages_per_rank,
                schedule=self.schedule, n_microbatches=self.n_microbatches, device=self.root_device,
                timeout=self._timeout, recompute=checkpoint_policy(self.activation_checkpointing),
                sharding=StageSharding.of(self.data_parallel, lambda: self._mesh.replica_mesh, self.root_device,
                                          self.precision_plugin.inner, tp, self.settings.fsdp_memory),
                compile_options=self.settings.compile,
            )  # fmt: skip
            self.partitions = [{"step": 0, "layers_per_stage": self.layers_per_stage}]
        self.model_to_device()
        self._stages.shard()  # compiled layers; units (built as such) checked, before the optimizers see them
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            with self._phase("set-up (tied parameters' optimizer settings)"):
                stages = self._stages
                stages.ties.check_shapes(stages.slots, stages.plan, self.pp_rank, self.optimizers)
        self.setup_precision_plugin()
        order = self._stages.split.param_order
        self.precision_plugin.clip_by_norm = GlobalNormClipping(
            order, self._stages.param_names, lambda: self._pipe, sharded=self._in_parts, holders=self._holders
        )
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- steps -------------------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not self._shard_data or self.lightning_module.trainer.state.fn == TrainerFn.PREDICTING:
            return dataloader
        shard, seed = self.distributed_sampler_kwargs, int(os.environ.get("PL_GLOBAL_SEED", 0))
        return shard_dataloader(dataloader, shard["rank"], shard["num_replicas"], seed)

    @override
    def on_train_start(self) -> None:
        n_parts = self._layout.parts[self.dp_rank][1] if self._layout else 1
        launcher.check_batch_sizes([self.lightning_module.trainer.train_dataloader], self.n_microbatches, n_parts)

    @override
    def on_validation_start(self) -> None:
        launcher.check_batch_sizes([self.lightning_module.trainer.val_dataloaders], self.n_microbatches)

    def _batch(self, batch: Any, *, train: bool = False) -> tuple[Any, Tensor]:
        assert self._layout is not None
        inputs, target = split_batch(self.lightning_module, batch)
        check_batch(first_dim(inputs), self.n_microbatches, self._layout.parts[self.dp_rank][1] if train else 1)
        if not train:
            return inputs, target
        # This replica's contiguous part of the training batch its shard delivered (see `shrink`). Evaluation
        # batches are not split: replicas of one shard evaluate the same batch, which weighs equally in the mean.
        self._batch_size = first_dim(inputs)
        return self._layout.take_part(self.dp_rank, (inputs, target))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self._stages is not None and self.lightning_module is not None
        inputs, target = self._batch(args[0] if args else kwargs["batch"], train=True)
        module, clock = self.lightning_module, DeviceClock(self.root_device)
        start = clock.now()
        params = [p for p in module.parameters() if p.requires_grad]
        step = module.trainer.global_step
        replicas = self._mesh.dp_group if self._mesh is not None else None
        host = self._mesh.dp_control if self._mesh is not None else None
        with self._phase(f"training step {step} (pipeline schedule)"), self.precision_plugin.train_step_context():
            loss = self._stages.train(inputs, target, params, replicas, host)
        self._schedule_span = (clock, start, clock.now())
        if replicas is not None:
            with self._phase(f"training step {step} (loss and buffers over replicas)"):
                self._stages.average_replicas(loss, replicas, self.dp_size, self._mesh.dp_control)
        self._stages.park_grads(params)  # Lightning zeroes gradients between `training_step` and `backward`
        module.log("train_loss", loss, prog_bar=True, on_step=True, batch_size=first_dim(inputs))
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None and self._stages is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._stages.restore_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.precision_plugin.val_step_context():
            return self._eval_step("val", args[0] if args else kwargs["batch"])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test", args[0] if args else kwargs["batch"])

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        inputs, target = self._batch(args[0] if args else kwargs["batch"])
        with self._phase("prediction (pipeline forward)"), self.precision_plugin.predict_step_context():
            return self._local.predict(inputs, target)

    def _eval_step(self, prefix: str, batch: Any) -> Tensor:
        assert self._stages is not None and self.lightning_module is not None
        inputs, target = self._batch(batch)
        with self._phase(f"{'validation' if prefix == 'val' else prefix} (pipeline forward)"):
            loss, result = self._stages.evaluate(inputs, target)
            self._evaluation.log(self.lightning_module, prefix, loss, result.output, target, first_dim(inputs))
        return loss

    # --- the whole model, for callbacks (collective; pipeline/stages.py, pipeline/reduce.py) -------------------------
    @property
    def layers_per_stage(self) -> list[int]:
        """The current partition (empty before the model is split)."""
        return list(self._stages.plan.layers_per_stage) if self._stages is not None else []

    @property
    def n_layers(self) -> int:
        """Number of pipeline layers of the model (0 before the model is split)."""
        return self._stages.slots.n_layers if self._stages is not None else 0

    @property
    def layer_param_counts(self) -> list[int]:
        """Parameter count of every pipeline layer (taken before the split)."""
        return list(self._stages.split.param_counts) if self._stages is not None else []

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds bit-identical parameters and persistent buffers (collective over the job)."""
        assert self.lightning_module is not None and self._mesh is not None
        state = self.lightning_module.state_dict()
        return replicas_in_sync(state, self._mesh.dp_control, self.dp_size, self._pipe.device)

    def param_norm(self) -> float:
        """L2 norm (float64) of all parameters of the unsplit model, across stages; tied ones counted once."""
        return self._local.param_norm(self._part_groups(), self._holders)

    def layer_editing(self) -> LayerEditor:
        """The role of callbacks that change layers' shapes (``protocol.LayerEditing``; ``pipeline/reshape.py``)."""
        return LayerEditor(self._local, self.optimizers, self.tensor_parallel_size)

    def shard_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the processes holding other parts of this stage's layers (collective over them).

        FSDP2's replicas and the tensor-parallel group; each process weighs its parts by ``reduce.held_share``.
        """
        for group in self._part_groups():
            dist.all_reduce(values := values.clone(), op=dist.ReduceOp.SUM, group=group)
        return values

    def _part_groups(self) -> list[dist.ProcessGroup]:
        return self._mesh.part_groups(self.data_parallel == "fsdp") if self._mesh is not None else []

    @property
    def _in_parts(self) -> bool:
        """Whether processes hold parts of their layers (FSDP2 shards, tensor-parallel splits)."""
        return self.data_parallel == "fsdp" or self.tensor_parallel_size > 1

    def tie_layers(self, param: Tensor) -> set[int]:
        """Indices of all pipeline layers sharing ``param`` (a local parameter) in the unsplit model; empty if none."""
        return self._stages.tie_layers(param) if self._stages is not None else set()

    def request_profile(self) -> None:
        """Profile the coming training step (callbacks call this in ``on_train_batch_start``; several may)."""
        self._local.request_profile()

    def profile_results(self) -> dict[int, dict[str, float]] | None:
        """Every layer's measured costs of the step just profiled (collective), or ``None`` if it was not profiled."""
        assert self._mesh is not None
        rows, mesh = len(self._mesh.layout.replicas), self._mesh  # every pipeline plans from the same numbers
        replicas = (mesh.stage_control or mesh.dp_control, rows) if rows > 1 else None
        return self._local.profile_results(self.optimizers[0] if self.optimizers else None, replicas)

    def on_layers_changed(self, layers: list[int] | None = None) -> None:
        """Rebuild stages and schedules (their boundaries' gradients may have changed) before the next step."""
        if self._stages is not None and self.lightning_module is not None:
            self._stages.layers_changed(self.lightning_module.trainer.global_step, layers)

    def changed_layers(self, step: int) -> list[int]:
        """The layers reported changed while ``step`` optimizer steps were done (the balancer reacts to them)."""
        return self._stages.changed_layers(step) if self._stages is not None else []

    # --- rebalancing: move layers, shrink and grow the world (pipeline/resize.py) ------------------------------------
    def repartition(self, layers_per_stage: list[int]) -> MigrationStats:
        """Move layers (with all their state) so that the pipeline runs ``layers_per_stage``; the math never changes.

        Every process must call it with the same plan; stages, schedule and optimizer groups are rebuilt.
        """
        assert self._stages is not None and self.lightning_module is not None
        lps = balance.validate_partition(layers_per_stage, self.n_layers, self.n_stages)
        new = StagePlan(tuple(lps), self.pp_size, self.schedule)
        if new == self._stages.plan:
            return MigrationStats(moves=[])
        with self._phase(f"layer migration {self.layers_per_stage} -> {lps}"):
            stats = self._stages.migrate(new, self.optimizers)
        return self._record(Resized(stats, {"step": self._global_step(), "layers_per_stage": lps}))

    @property
    def fsdp_memory_in_force(self) -> str:
        """How FSDP2 units hold a step's weights and gradients now: ``"fast"`` or ``"lean"``."""
        lean = self._stages.sharding.lean if self._stages is not None else self.fsdp_memory == "lean"
        return "lean" if lean else "fast"

    def set_fsdp_memory(self, way: str) -> None:
        """Hold FSDP2 units' weights and gradients ``way`` (``"fast"``, ``"lean"``) from the next step on."""
        self._local.set_lean(way == "lean")

    def run_neighbours(self, stage_of: Callable[[int], DiffusionStage]) -> NeighbourStats:
        """Drive this process's stage ``stage_of(pp_rank)`` of the diffusion protocol, point-to-point to neighbours."""
        with self._phase("diffusion balancing between pipeline neighbours"):
            return run_stage(stage_of(self.pp_rank), self._pipe)

    @property
    def pipeline_nodes(self) -> list[Any] | None:
        """The node of every pipeline rank (with replicas: the tuple of their nodes), for a repack that frees nodes."""
        return self._resizer.pipeline_nodes(self._layout) if self._layout else None

    @property
    def waiting(self) -> int:
        """Released processes waiting to be re-admitted by :meth:`grow` (one pipeline, one stage per rank only)."""
        return self._resizer.waiting

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a shrink (ranks, hosts, whole nodes freed)."""
        return self._resizer.releases

    def shrink(self, keep_ranks: list[int], layers_per_stage: list[int], *, on_release: str = "exit",
               release_to: release.ReleaseHandler | None = None) -> MigrationStats:  # fmt: skip
        """Consolidate onto pipeline ranks ``keep_ranks``, release the others (collective; :meth:`Resizer.shrink`)."""
        return self._record(self._resizer.shrink(keep_ranks, layers_per_stage, on_release=on_release,
                                                 release_to=release_to))  # fmt: skip

    def grow(self, layers_per_stage: list[int]) -> MigrationStats:
        """Re-admit waiting processes as new stages of ``layers_per_stage`` (collective; :meth:`Resizer.grow`)."""
        return self._record(self._resizer.grow(layers_per_stage))

    def _global_step(self) -> int:
        return self.lightning_module.trainer.global_step if self.lightning_module is not None else -1

    def _record(self, resized: Resized) -> MigrationStats:
        self.partitions.append(resized.partition)  # the strategy alone writes its partition history
        return resized.stats

    # --- collectives (over the whole job, as Lightning expects) ------------------------------------------------------
    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if fabric_dist._distributed_is_initialized():
            with self._phase(f"a barrier ({name or 'Lightning'})"):
                groups.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not fabric_dist._distributed_is_initialized():
            return obj
        payload = [obj]
        with self._phase("a broadcast"):  # host data: over the job's CPU group once it exists
            dist.broadcast_object_list(payload, src, group=self._mesh.control if self._mesh else None)
        return payload[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        with self._phase("a reduction of logged values"):
            return fabric_dist._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # --- checkpoints: one file, the unsplit model's keys, optimizer state by name (pipeline/checkpoint.py) -----------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights are loaded after the split: each process reads only its own layers

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return ckpt.named_optimizer_state(getattr(optimizer, "_optimizer", optimizer), self._local.param_names())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._layout is None:
            return
        checkpoint["dynmo"] = ckpt.record_layout(self.partitions, self.world_size, self._layout)
        with self._phase(f"checkpoint save ({os.fspath(filepath)})"):
            merged = sharded.save(checkpoint, filepath, self._mesh, self.checkpoint_format, self._in_parts,
                                  self.data_parallel in FSDP_MODES or self.tensor_parallel_size > 1)  # fmt: skip
        if merged is not None and self.is_global_zero:
            self.checkpoint_io.save_checkpoint(merged, filepath, storage_options=storage_options)
        release_host_memory()  # the write's buffers: back to the system, not kept in the heap

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(ckpt.UNSAFE_LOAD)
        if sharded.is_sharded(checkpoint_path):
            checkpoint = sharded.load_meta(checkpoint_path)  # each stage reads its own tensors from the shards
        else:  # weights_only=True also for URLs, where Lightning's default would unpickle freely
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True)
        ckpt.warn_layout_change(checkpoint, checkpoint_path, self.dp_size)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None and self._stages is not None
        group = self._mesh.control if self._mesh is not None else None
        sharded.load_model(self.lightning_module, checkpoint, self._stages.split.state_keys, strict, group)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        group = self._mesh.control if self._mesh is not None else None
        sharded.load_optimizers(self.optimizers, checkpoint, self._local.param_names(), group, self.root_device)

    @override
    def teardown(self) -> None:
        self._resizer.end()  # heartbeats stop; processes released with on_release="wait" may exit now
        module = self._lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            self._lightning_module = None  # set-up failed before the split: moving meta tensors would mask the error
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        description = "DynMo pipeline parallelism (torch.distributed.pipelining)"
        strategy_registry.register(cls.strategy_name, cls, description=description)
