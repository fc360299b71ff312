"""DynMoStrategy: pipeline-parallel training of a pipeline-ready LightningModule across processes.

The Lightning face: the strategy's hooks, its steps, checkpoints and collectives. Where the job's processes are is
its one :class:`~dynmo_lightning.pipeline.topology.world.World`; what callbacks ask of the pipeline (its shape and
history, layer events, rebalancing) is :class:`~dynmo_lightning.strategy.control.PipelineHandle`
(``strategy.pipeline_control``), which holds the stages this process runs. Every other job is a collaborator in its
room under :mod:`dynmo_lightning.pipeline`.

Lightning's closure calls ``training_step``, zeroes the gradients, then calls ``strategy.backward``; a schedule runs
forward *and* backward of all micro-batches at once, so ``training_step`` runs it and parks the gradients and
``backward`` puts them back. The rest is stock Lightning: hooks, clipping (by the global norm), optimizers, schedulers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
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

from dynmo_lightning import callbacks
from dynmo_lightning.pipeline.checkpoint import sharded
from dynmo_lightning.pipeline.checkpoint import single_file as ckpt
from dynmo_lightning.pipeline.checkpoint.resume import count_the_epoch_in_progress
from dynmo_lightning.pipeline.elastic import survivors as groups
from dynmo_lightning.pipeline.elastic.lifetimes import torchrun_world_store
from dynmo_lightning.pipeline.elastic.lost import InPlace, check_job_store
from dynmo_lightning.pipeline.elastic.mirror import ShardMirror
from dynmo_lightning.pipeline.parallel.data_parallel import FSDP_MODES, StageSharding
from dynmo_lightning.pipeline.parallel.tensor_parallel import TensorParallel
from dynmo_lightning.pipeline.stage.evaluation import PipelineEvaluation
from dynmo_lightning.pipeline.stage.local import LocalStages
from dynmo_lightning.pipeline.stage.reduce import GlobalNormClipping
from dynmo_lightning.pipeline.stage.runtime import first_dim
from dynmo_lightning.pipeline.topology import pending
from dynmo_lightning.pipeline.topology.data import TakenShards, shard_dataloader
from dynmo_lightning.pipeline.topology.heartbeats import PeerLostError
from dynmo_lightning.pipeline.topology.world import World
from dynmo_lightning.profiling import DeviceClock, release_host_memory
from dynmo_lightning.recompute import checkpoint_policy
from dynmo_lightning.settings import build, configured_by, from_settings
from dynmo_lightning.strategy import checks, launcher
from dynmo_lightning.strategy.arguments import PLUGINS, StrategyArguments, StrategySettings
from dynmo_lightning.strategy.control import Forwarded, PipelineHandle
from dynmo_lightning.strategy.plugins import WrappedPlugins
from dynmo_lightning.strategy.steps import step_batch


class DynMoStrategy(WrappedPlugins):
    """Pipeline parallelism for pipeline-ready LightningModules (see :mod:`dynmo_lightning.protocol`).

    Each process holds one pipeline stage (or ``stages_per_rank`` interleaved stages): a contiguous run of the
    module's ``pipeline_layers()``; other stages' layers are dropped, and meta-device layers are materialised only
    where they live, each from its own seed. With ``data_parallel_size=D`` the ``W`` processes form a ``D x (W / D)``
    device mesh (:attr:`device_mesh`, ``("dp", "pp")``): ``D`` replicas of a pipeline on consecutive global ranks;
    data is sharded over replicas, gradients averaged over them, balancing decided once and applied in every replica.
    Callbacks reach the pipeline through :attr:`pipeline_control` (:class:`~dynmo_lightning.protocol.PipelineControl`).

    Every setting is a field of :class:`~dynmo_lightning.strategy.arguments.StrategySettings` (its docstrings
    say what each does; one name and one default, shared with the Hydra group ``strategy``): give them as keyword
    arguments, ``DynMoStrategy(n_microbatches=8, schedule="zbv", stages_per_rank=2)``, or as one settings object,
    ``DynMoStrategy.from_settings(settings)``. ``accelerator``, ``parallel_devices``, ``cluster_environment`` (torchrun,
    SLURM, Lightning's own launcher), ``checkpoint_io`` (wrapped to write atomically) and ``precision_plugin`` (wrapped
    to clip by the norm over all stages) are set by the Trainer.
    """

    strategy_name = "dynmo"
    #: The world's cluster environment and nodes: Lightning sets them, a shrink or grow replaces them in the world.
    cluster_environment = Forwarded("_world", "environment")
    num_nodes = Forwarded("_world")

    @configured_by(StrategyArguments)
    def __init__(self, **kwargs: Any) -> None:
        plugins = {name: kwargs.pop(name, None) for name in PLUGINS}
        s = build(StrategySettings, "DynMoStrategy", "strategy", kwargs)
        step = lambda: self.lightning_module.trainer.global_step if self.lightning_module is not None else -1  # noqa: E731
        units = s.data_parallel in FSDP_MODES  # FSDP2 / replicate units work over the replica groups
        self._world = World(s.data_parallel_size, s.tensor_parallel_size, s.timeout_delta, float(s.heartbeat_timeout),
                            step, unit_groups=units)  # fmt: skip
        super().__init__(**plugins)
        self.settings = s
        self.activation_checkpointing = s.activation_checkpointing
        self.n_microbatches, self.schedule, self.stages_per_rank = s.n_microbatches, s.schedule, s.stages_per_rank
        self.partition, self.data_parallel_size, self.data_parallel = s.partition, s.data_parallel_size, s.data_parallel
        self.tensor_parallel_size, self.fsdp_memory = s.tensor_parallel_size, s.fsdp_memory
        self.heartbeat_timeout = float(s.heartbeat_timeout)
        self.checkpoint_format = s.checkpoint_format
        self.process_group_backend = s.process_group_backend  # resolved per device at start-up
        self._shard_data: bool | None = None  # the Trainer's use_distributed_sampler (the strategy shards itself)
        self._pipeline = PipelineHandle(self, self._world)
        #: What evaluation steps log: loss, perplexity of token targets, the module's ``pipeline_eval_step``.
        self._evaluation = PipelineEvaluation()

    @classmethod
    def from_settings(cls, settings: StrategySettings, **overrides: Any) -> Self:
        """The strategy of one settings object (``overrides`` replace some of its fields, or give plugins)."""
        return from_settings(cls, StrategySettings, settings, overrides)

    @property
    def pipeline_control(self) -> PipelineHandle:
        """The pipeline's roles for callbacks (``protocol.PipelineControl``): its shape, layer events, rebalancing."""
        return self._pipeline

    # --- processes, devices and plugins ------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning then syncs logs and wraps dataloaders with a (pipeline-aware) sampler."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        if self._world.device is not None:
            return self._world.device
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
        world = self._world
        shard, n_shards = world.layout.shards[world.dp_rank] if world.layout else (world.dp_rank, world.dp_size)
        return {"num_replicas": n_shards, "rank": shard}

    # --- start-up ----------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._launcher = launcher.PipelineLauncher(self)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        checks.check_world(self.world_size, self.data_parallel_size, self.tensor_parallel_size)
        device = self.root_device
        backend = self.process_group_backend or fabric_dist._get_default_process_group_backend_for_device(device)
        self.process_group_backend = backend
        if self.settings.on_peer_lost == "recover" and self._pipeline.resizer.in_place is None:
            check_job_store()
            # a lost FSDP2 shard's copy lives on a replica peer (idle where stages are held whole)
            mirror = ShardMirror(torch.device("cpu") if backend == "gloo" else device)
            self._pipeline.resizer.in_place = InPlace(self._world.timeout, mirror)
        kwargs: dict[str, Any] = {"device_id": device} if device.type != "cpu" else {}
        store = torchrun_world_store(self._world.timeout)  # under torchrun: not a dead world's keys
        if store is not None:
            kwargs["store"] = store
        fabric_dist._init_dist_connection(self.cluster_environment, backend, timeout=self._world.timeout, **kwargs)
        self._world.device = device  # pinned: a shrink renumbers local ranks, not devices
        self._pipeline.resizer.start(self.node_rank)

    def set_world_ranks(self) -> None:
        """Derive global rank and world size from node rank, local rank and processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def connect(self, model: pl.LightningModule) -> None:
        checks.check_model(model)
        super().connect(model)

    @override
    def model_sharded_context(self) -> Any:
        # Layers made in `configure_model` start on the meta device; each stage materialises only its own.
        return torch.device("meta")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module, world, handle = self.lightning_module, self._world, self._pipeline
        checks.check_trainer(trainer, module, self.precision_plugin.inner)
        callbacks.use_pipeline_summaries(trainer.callbacks)  # Lightning's would describe this stage as the model
        # Lightning would give every training loader a shuffling sampler: `process_dataloader` keeps the user's order.
        connector = trainer._accelerator_connector
        if self._shard_data is None:
            self._shard_data = connector.use_distributed_sampler
        connector.use_distributed_sampler = self._shard_data and trainer.state.fn == TrainerFn.PREDICTING
        # Before the split: layers are built in their final dtype, and as parts where parts are what a process holds.
        self.precision_plugin.convert_module(module)
        if handle.stages is None:
            tp = TensorParallel(module, world) if self.tensor_parallel_size > 1 else None
            handle.stages = LocalStages.from_module(
                module, self.partition, world, stages_per_rank=self.stages_per_rank,
                schedule=self.schedule, n_microbatches=self.n_microbatches, device=self.root_device,
                timeout=world.timeout, recompute=checkpoint_policy(self.activation_checkpointing),
                sharding=StageSharding.of(self.data_parallel, world, self.root_device, self.precision_plugin.inner,
                                          tp, self.settings.fsdp_memory),
                compile_options=self.settings.compile,
            )  # fmt: skip
            handle.partitions = [{"step": 0, "layers_per_stage": handle.layers_per_stage}]
        self.model_to_device()
        handle.local.shard()  # compiled layers; units (built as such) checked, before the optimizers see them
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            with world.phase("set-up (tied parameters' optimizer settings)"):
                handle.local.ties.check_shapes(handle.local.slots, handle.local.plan, world.pp_rank, self.optimizers)
        self.setup_precision_plugin()
        in_parts = self.data_parallel == "fsdp" or self.tensor_parallel_size > 1  # gradients held in parts
        self.precision_plugin.clip_by_norm = GlobalNormClipping(
            handle.local.split.param_order, handle.local.param_names, world, sharded=in_parts
        )
        if handle.resizer.in_place is not None:  # an optimizer step is applied once every process is done with it
            self.precision_plugin.run_closure = handle.committed
            self.precision_plugin.run_step = handle.mirrored
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
        world = self._world
        n_parts = world.layout.parts[world.dp_rank][1] if world.layout else 1
        checks.check_batch_sizes([self.lightning_module.trainer.train_dataloader], self.n_microbatches, n_parts)
        if self._pipeline.resizer.in_place is not None:  # a replica must be able to take over a lost one's data
            try:
                TakenShards(self.lightning_module.trainer.train_dataloader, [])
            except ValueError as e:
                raise ValueError(f"strategy.on_peer_lost='recover': {e} (the strategy shards a map-style DataLoader "
                                 "with a batch_size itself; use on_peer_lost='stop' otherwise)") from None

    @override
    def on_validation_start(self) -> None:
        checks.check_batch_sizes([self.lightning_module.trainer.val_dataloaders], self.n_microbatches)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = args[0] if args else kwargs["batch"]
        while True:
            try:
                self._pipeline.keep_copies()  # under FSDP2, copies of the shards as the step starts with them
                return self._training_step(self._pipeline.with_taken_shards(batch))
            except PeerLostError as lost:  # recovering without restart: the step again, on the survivors' world
                self._pipeline.recover(lost)

    def _training_step(self, batch: Any) -> Tensor:
        assert self.lightning_module is not None
        module, world, handle = self.lightning_module, self._world, self._pipeline
        inputs, target, handle.batch_size = step_batch(module, world, batch, self.n_microbatches, train=True)
        clock = DeviceClock(self.root_device)
        start = clock.now()
        params = [p for p in module.parameters() if p.requires_grad]
        step = module.trainer.global_step
        replicas = world.mesh.dp_group if world.mesh is not None else None
        host = world.mesh.dp_control if world.mesh is not None else None
        with world.phase(f"training step {step} (pipeline schedule)"), self.precision_plugin.train_step_context():
            loss = handle.local.train(inputs, target, params, replicas, host)
        handle.schedule_span = (clock, start, clock.now())
        if replicas is not None:
            with world.phase(f"training step {step} (loss and buffers over replicas)"):
                handle.local.average_replicas(loss, replicas, world.dp_size, host)
        handle.local.park_grads(params)  # Lightning zeroes gradients between `training_step` and `backward`
        module.log("train_loss", loss, prog_bar=True, on_step=True, batch_size=first_dim(inputs))
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline.local.restore_grads()
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
        batch = args[0] if args else kwargs["batch"]
        inputs, target, _ = step_batch(self.lightning_module, self._world, batch, self.n_microbatches)
        with self._world.phase("prediction (pipeline forward)"), self.precision_plugin.predict_step_context():
            return self._pipeline.local.predict(inputs, target)

    def _eval_step(self, prefix: str, batch: Any) -> Tensor:
        assert self.lightning_module is not None
        stages = self._pipeline.local
        inputs, target, size = step_batch(self.lightning_module, self._world, batch, self.n_microbatches)
        with self._world.phase(f"{'validation' if prefix == 'val' else prefix} (pipeline forward)"):
            loss, result = stages.evaluate(inputs, target)
            self._evaluation.log(self.lightning_module, prefix, loss, result.output, target, size, stages.runtime)
        return loss

    # --- collectives (over the whole job, as Lightning expects) ------------------------------------------------------
    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        def barrier() -> None:
            if fabric_dist._distributed_is_initialized():
                with self._world.phase(f"a barrier ({name or 'Lightning'})"):
                    groups.barrier(self.root_device)

        self._pipeline.surviving(barrier)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        def broadcast() -> TBroadcast:
            if not fabric_dist._distributed_is_initialized():
                return obj
            payload = [obj]
            with self._world.phase("a broadcast"):  # host data: over the job's CPU group once it exists
                dist.broadcast_object_list(payload, src, group=self._world.host_group)
            return payload[0]

        return self._pipeline.surviving(broadcast)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor

        def reduce() -> Any:
            with self._world.phase("a reduction of logged values"):
                return fabric_dist._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

        return self._pipeline.surviving(reduce)

    # --- checkpoints: one file, the unsplit model's keys, optimizer state by name (pipeline/checkpoint/) -------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights are loaded after the split: each process reads only its own layers

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        names = self._pipeline.local.param_names()
        return ckpt.named_optimizer_state(getattr(optimizer, "_optimizer", optimizer), names)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        world = self._world
        if world.layout is None:
            return
        in_parts, units = self.data_parallel == "fsdp", self.data_parallel in FSDP_MODES
        tp = self.tensor_parallel_size > 1
        while True:
            checkpoint["dynmo"] = ckpt.record_layout(self._pipeline.partitions, self.world_size, world.layout)
            try:
                with world.phase(f"checkpoint save ({os.fspath(filepath)})"):
                    merged = sharded.save(checkpoint, filepath, world.mesh, self.checkpoint_format, in_parts or tp,
                                          units or tp, background=self.settings.async_checkpoint)  # fmt: skip
                    if self._pipeline.resizer.in_place is not None:  # a loss anywhere in the save: all write again
                        groups.barrier(self.root_device)
                break
            except PeerLostError as lost:  # recovering without restart: written again, by the survivors
                self._pipeline.recover(lost)
                # what Lightning gathered names the broken world's shards (FSDP2): gathered again from the new world
                checkpoint["state_dict"] = self.lightning_module_state_dict()
                if "optimizer_states" in checkpoint:
                    checkpoint["optimizer_states"] = [self.optimizer_state(o) for o in self.optimizers]
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
        ckpt.warn_layout_change(checkpoint, checkpoint_path, self._world.dp_size)
        count_the_epoch_in_progress(checkpoint)  # Lightning's count after a resume at an epoch's end
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        keys = self._pipeline.local.split.state_keys
        sharded.load_model(self.lightning_module, checkpoint, keys, strict, self._world.host_group)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        names, group = self._pipeline.local.param_names(), self._world.host_group
        sharded.load_optimizers(self.optimizers, checkpoint, names, group, self.root_device)

    @override
    def teardown(self) -> None:
        pending.settle()  # a checkpoint still being written in the background: complete when fit returns
        self._pipeline.resizer.end()  # heartbeats stop; processes released with on_release="wait" may exit now
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
