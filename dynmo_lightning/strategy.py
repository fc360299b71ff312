"""DynMoStrategy: pipeline-parallel training of a pipeline-ready LightningModule across processes.

Lightning face only: the pipeline runtime (``dynmo_lightning.pipeline``) builds stages and runs the schedules from
``torch.distributed.pipelining``; the planning core (``dynmo_lightning.balance``) chooses partitions.

How a training step works under Lightning's automatic optimization. Lightning's closure calls ``training_step``,
then zeroes the gradients, then calls ``strategy.backward``. A pipeline schedule runs forward *and* backward of all
micro-batches in one go, so :meth:`DynMoStrategy.training_step` runs the whole schedule, moves the resulting
gradients aside, and :meth:`DynMoStrategy.backward` puts them back. Everything after that is stock Lightning:
``on_after_backward``, ``on_before_optimizer_step``, gradient clipping (by the norm over *all* stages), the
optimizer step and LR schedulers all see the pipeline's gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from dynmo_lightning import balance
from dynmo_lightning.pipeline.checkpoint import (
    local_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
)
from dynmo_lightning.pipeline.groups import (
    SHUTDOWN_KEY,
    ResizedEnvironment,
    control_store,
    restart_world,
    share_ports,
)
from dynmo_lightning.pipeline.layers import LayerSlots, RemoteLayer
from dynmo_lightning.pipeline.migration import MigrationStats, migrate, replicate
from dynmo_lightning.pipeline.runtime import (
    SCHEDULES,
    PipelineRuntime,
    StagePlan,
    check_schedule,
    first_dim,
    micro_batch_error,
)
from dynmo_lightning.pipeline.ties import TiedParameters, find_ties
from dynmo_lightning.pipeline.watchdog import PeerLostError, Watchdog, is_distributed_failure
from dynmo_lightning.profiling import LayerCost, static_memory
from dynmo_lightning.protocol import ProtocolError, check_protocol, init_layer, split_batch

#: Initial partitions that ``DynMoStrategy(partition=...)`` accepts by name (or a list of layers per stage).
PARTITIONS = ("uniform", "params")

#: What a process released by consolidation does: leave at once, idle until training ends, or join other released
#: processes in a new data-parallel replica of the pipeline.
ON_RELEASE = ("exit", "wait", "data_parallel")

#: How long a released process waits for the end of training (``on_release="wait"``).
_RELEASED_WAIT = timedelta(days=7)


class DynMoStrategy(ParallelStrategy):
    """Pipeline parallelism for pipeline-ready LightningModules (see :mod:`dynmo_lightning.protocol`).

    With ``data_parallel_size=D`` the job's ``W`` processes form a ``D x (W / D)`` device mesh
    (:attr:`device_mesh`, dimensions ``("dp", "pp")``): ``D`` replicas of a pipeline of ``W / D`` processes, each
    replica on consecutive global ranks (so a pipeline stays within a node where it fits). The sampler shards the
    data over the replicas; each stage's gradients are averaged over its replicas after the backward; balancing
    decisions are made once and applied in every replica alike.

    Each process holds one pipeline stage (or ``stages_per_rank`` interleaved stages): a contiguous run of the
    module's ``pipeline_layers()``. Layers of other stages are dropped from the process (their memory is freed);
    layers created on the meta device in ``configure_model`` are materialised only where they are needed, each from
    its own seed, so a layer has the same initial weights whichever stage builds it.

    Args:
        n_microbatches: micro-batches per batch; the batch size must be a multiple of it.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"`` (schedules of ``torch.distributed.pipelining``).
        partition: initial layers per stage: ``"uniform"`` (by layer count), ``"params"`` (balance parameter counts,
            as DeepSpeed does), or an explicit list such as ``[3, 5]``.
        stages_per_rank: stages per process; more than one needs ``schedule="interleaved_1f1b"``.
        data_parallel_size: replicas of the pipeline; the number of processes must be a multiple of it. The
            dataloader's batch size is per replica, as with DDP.
        timeout: timeout of every collective and point-to-point operation.
        heartbeat_timeout: seconds of silence after which a process of the job counts as lost; the others then stop
            with an error naming it and what the job was doing (instead of waiting for ``timeout``).
        process_group_backend: ``"gloo"``/``"nccl"``; by default chosen from the device.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer (torchrun, SLURM, Lightning's own launcher, ...).
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.

    """

    strategy_name = "dynmo"

    def __init__(
        self,
        n_microbatches: int = 4,
        schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b",
        partition: str | list[int] = "uniform",
        stages_per_rank: int = 1,
        data_parallel_size: int = 1,
        timeout: timedelta | float = timedelta(minutes=5),
        heartbeat_timeout: float = 15.0,
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"strategy.n_microbatches={n_microbatches!r} must be a positive integer")
        if schedule not in SCHEDULES:
            raise ValueError(f"strategy.schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
        if isinstance(partition, str):
            if partition not in PARTITIONS:
                raise ValueError(
                    f"strategy.partition={partition!r} is not one of {list(PARTITIONS)} or a list of layers per stage"
                )
        else:
            partition = [int(n) for n in partition]
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
            raise ValueError(f"strategy.stages_per_rank={stages_per_rank!r} must be a positive integer")
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"strategy.data_parallel_size={data_parallel_size!r} must be a positive integer")
        self.data_parallel_size = data_parallel_size
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.partition = partition
        self.stages_per_rank = stages_per_rank
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        if heartbeat_timeout <= 0:
            raise ValueError(f"strategy.heartbeat_timeout={heartbeat_timeout} must be > 0 seconds")
        self.heartbeat_timeout = float(heartbeat_timeout)
        self._watchdog: Watchdog | None = None
        self._phase: str | None = None
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.runtime: PipelineRuntime | None = None
        self._slots: LayerSlots | None = None
        self._ties = TiedParameters([], self._layout, self._timeout)
        #: Global ranks of every pipeline replica, by pipeline rank (the rows of the device mesh).
        self._replicas: list[list[int]] = []
        #: Per replica: ``(shard, n_shards)`` the sampler gives it and ``(part, n_parts)`` of that shard's batches it
        #: trains on (replicas made from released processes split the batches of the replica they came from).
        self._shards: list[tuple[int, int]] = []
        self._parts: list[tuple[int, int]] = []
        self._pp_group: dist.ProcessGroup | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self.device_mesh: Any = None
        #: Batch size the sampler delivered in the last training step (before a replica takes its part).
        self._batch_size: int | None = None
        self._global_keys: set[str] = set()
        #: Parameter count of every pipeline layer (taken before the split).
        self.layer_param_counts: list[int] = []
        #: Names of all parameters of the unsplit model, in its order.
        self._param_order: list[str] = []
        self._pending_grads: list[tuple[Tensor, Tensor]] = []
        self._eval_metrics: dict[str, Any] = {}
        self._control: dist.TCPStore | None = None
        self._profiled: dict[int, dict[str, float]] | None = None
        #: Wall time of the last training step's pipeline schedule (forward and backward of all micro-batches).
        self.schedule_seconds = 0.0
        #: ``[{"step", "layers_per_stage"}]``: the initial partition and every change.
        self.partitions: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------------------------------------------------
    # Processes and devices
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Always true: Lightning then syncs logs and wraps dataloaders with a (pipeline-aware) sampler."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of one pipeline consume the same batch; the data is sharded over the replicas.
        shard, n_shards = self._shards[self.dp_rank] if self._shards else (self.dp_rank, self.dp_size)
        return {"num_replicas": n_shards, "rank": shard}

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline's process group (``None``: the default group, when there is one replica)."""
        return self._pp_group

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this stage's replicas (``None`` with one replica)."""
        return self._dp_group

    @property
    def pp_size(self) -> int:
        """Number of processes in the pipeline."""
        if self._replicas:
            return len(self._replicas[0])
        return self.world_size // self.data_parallel_size

    @property
    def pp_rank(self) -> int:
        """Rank of this process in the pipeline."""
        if self._replicas:
            return self._replicas[self.dp_rank].index(self.global_rank)
        return self.global_rank % self.pp_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of the pipeline (grows when released processes form new ones)."""
        return len(self._replicas) if self._replicas else self.data_parallel_size

    @property
    def dp_rank(self) -> int:
        """Index of this process's replica."""
        if self._replicas:
            return next(d for d, ranks in enumerate(self._replicas) if self.global_rank in ranks)
        return self.global_rank // self.pp_size

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank (the rows of :attr:`device_mesh`)."""
        return [list(ranks) for ranks in self._replicas]

    def _layout(self) -> tuple[list[list[int]], int]:
        return self._replicas, self.dp_rank

    @property
    def n_stages(self) -> int:
        """Number of (virtual) pipeline stages."""
        return self.pp_size * self.stages_per_rank

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if self.world_size % self.data_parallel_size:
            raise ValueError(
                f"strategy.data_parallel_size={self.data_parallel_size} does not divide the job's {self.world_size} "
                "processes (Trainer devices x num_nodes): every replica needs the same number of pipeline stages. "
                f"Use a divisor of {self.world_size}, or change the number of processes."
            )
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        d, p = self.data_parallel_size, self.world_size // self.data_parallel_size
        self._shards = [(i, d) for i in range(d)]
        self._parts = [(0, 1)] * d
        self._build_mesh([list(range(i * p, (i + 1) * p)) for i in range(d)])
        self._start_watchdog(share_ports(1)[0])

    def _build_mesh(self, replicas: list[list[int]]) -> None:
        """Make the ``("dp", "pp")`` device mesh of ``replicas`` (collective: every process makes every group).

        The groups are made here (with the strategy's timeout) and handed to ``DeviceMesh.from_group``: the mesh's own
        group creation would use torch's 30-minute default timeout.
        """
        from torch.distributed.device_mesh import DeviceMesh

        self._replicas = replicas
        me = self.global_rank
        d, p = len(replicas), len(replicas[0])
        pp_group = dp_group = None
        for ranks in replicas:
            group = dist.new_group(ranks, timeout=self._timeout) if d > 1 else _group.WORLD
            if me in ranks:
                pp_group = group
        for stage in range(p):
            ranks = [replica[stage] for replica in replicas]
            group = dist.new_group(ranks, timeout=self._timeout)
            if me in ranks:
                dp_group = group
        # One replica: the pipeline is the default group (as before data parallelism existed).
        self._pp_group = pp_group if d > 1 else None
        self._dp_group = dp_group if d > 1 else None
        self.device_mesh = DeviceMesh.from_group(
            [dp_group, pp_group], self.root_device.type, mesh=replicas, mesh_dim_names=("dp", "pp")
        )

    def _start_watchdog(self, port: int) -> None:
        assert self.cluster_environment is not None
        if self._watchdog is not None:
            self._watchdog.stop()
        self._watchdog = Watchdog(
            self.cluster_environment.main_address,
            port,
            rank=self.global_rank,
            world_size=self.world_size,
            phase=lambda: self._phase,
            interval=min(2.0, self.heartbeat_timeout / 5),
            stale_after=self.heartbeat_timeout,
        )

    @contextlib.contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        """Name what the job does (for failure messages); turn a lost peer's error into one that names it."""
        previous, self._phase = self._phase, phase
        try:
            yield
        except PeerLostError:
            raise
        except Exception as e:
            if self._watchdog is not None and is_distributed_failure(e):
                step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
                raise self._watchdog.explain(e, step) from e
            raise
        finally:
            self._phase = previous

    def set_world_ranks(self) -> None:
        """Derive global rank and world size from node rank, local rank and processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----------------------------------------------------------------------------------------------------------------
    # Model set-up: validate, split, materialise
    # ----------------------------------------------------------------------------------------------------------------
    @override
    def connect(self, model: pl.LightningModule) -> None:
        missing = [m for m in ("pipeline_layers", "pipeline_loss") if not callable(getattr(model, m, None))]
        if missing:
            check_protocol(model)  # raises the explanatory ProtocolError
        if not is_overridden("training_step", model):
            raise ProtocolError(
                f"{type(model).__name__} has no training_step; Lightning requires one even though DynMoStrategy runs "
                "the pipeline itself. Subclass dynmo_lightning.PipelineModule (it provides the steps from "
                "pipeline_layers/pipeline_loss, also for single-process runs) instead of LightningModule."
            )
        super().connect(model)

    @override
    def model_sharded_context(self) -> Any:
        # Layers made in `configure_model` start on the meta device; each stage materialises only its own.
        return torch.device("meta")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._check_trainer(trainer, module)
        if self._slots is None:
            self._split(module)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        assert self._slots is not None
        self.runtime = PipelineRuntime(
            self._slots,
            StagePlan(tuple(self.partitions[-1]["layers_per_stage"]), self.pp_size),
            rank=self.pp_rank,
            group=self.pp_group,
            device=self.root_device,
            schedule=self.schedule,
            n_microbatches=self.n_microbatches,
            loss_fn=module.pipeline_loss,
        )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            with self._in_phase("set-up (tied parameters' optimizer settings)"):
                self._ties.check_shapes(self._slots, self.runtime.plan, self.pp_rank, self._raw_optimizers())
        self.setup_precision_plugin()
        # Clipping by norm must use the norm over all stages' gradients, as the unsplit model would.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_trainer(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported by "
                "DynMoStrategy: the pipeline already accumulates gradients over micro-batches. Use a larger batch "
                "with strategy n_microbatches instead (e.g. multiply both by the accumulation factor)."
            )
        if not module.automatic_optimization:
            raise ValueError(
                "DynMoStrategy needs automatic optimization (the pipeline schedule runs backward itself); remove "
                "`self.automatic_optimization = False` from the module."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "precision='16-mixed' needs gradient scaling inside the pipeline schedule, which DynMoStrategy does "
                "not do; use precision='bf16-mixed' (or '32-true')."
            )

    def _split(self, module: pl.LightningModule) -> None:
        """Choose the initial partition, drop other stages' layers, materialise this stage's."""
        layers = check_protocol(module)
        if any(isinstance(layer, RemoteLayer) for layer in layers):
            raise ProtocolError(
                f"{type(module).__name__} was already split into pipeline stages by another DynMoStrategy run; "
                "build a fresh module (or load it from a checkpoint) for a new Trainer."
            )
        layer_params = {id(p) for layer in layers for p in layer.parameters()}
        outside = [name for name, p in module.named_parameters() if id(p) not in layer_params]
        if outside:
            raise ProtocolError(
                f"{type(module).__name__} has parameters outside its pipeline_layers(): {outside[:5]}. Every "
                "parameter must belong to a pipeline layer so that it lives on exactly one stage."
            )
        self.layer_param_counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        layers_per_stage = self._initial_partition(layers)
        plan = StagePlan(tuple(layers_per_stage), self.pp_size)
        self._global_keys = set(module.state_dict().keys())
        self._param_order = [name for name, _ in module.named_parameters()]
        slots = LayerSlots(module, layers)
        # Found before the split: materialising or dropping layers separates what they share.
        self._ties = TiedParameters(find_ties(module, layers, slots.names), self._layout, self._timeout)
        mine = set(plan.layers_of_rank(self.pp_rank))
        seed = int(getattr(module, "pipeline_init_seed", 0))
        for i in range(len(layers)):
            if i not in mine:
                slots.remove(i)
                continue
            layer = slots.get(i)
            if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
                layer.to_empty(device=self.root_device)
                init_layer(module, i, layer, seed)
        self._slots = slots
        self.partitions = [{"step": 0, "layers_per_stage": list(layers_per_stage)}]
        self._ties.retie(slots, [])
        self._ties.prepare(plan)
        self._ties.check_shapes(slots, plan, self.pp_rank)
        self._ties.sync_values(slots, plan, self.pp_rank)

    def _initial_partition(self, layers: list[torch.nn.Module]) -> list[int]:
        n_layers, n_stages = len(layers), self.n_stages
        if n_stages > n_layers:
            raise ValueError(
                f"{self.pp_size} processes x stages_per_rank={self.stages_per_rank} = {n_stages} pipeline stages, "
                f"but the model has only {n_layers} layers: every stage needs at least one layer. Use fewer devices "
                "(Trainer devices/num_nodes) or a deeper model."
            )
        check_schedule(self.schedule, self.pp_size, n_stages, self.n_microbatches)
        if isinstance(self.partition, list):
            if len(self.partition) != n_stages:
                raise ValueError(
                    f"strategy.partition={self.partition} has {len(self.partition)} stages but the Trainer runs "
                    f"{self.pp_size} processes x stages_per_rank={self.stages_per_rank} = {n_stages} stages: give "
                    f"one entry per stage, or change Trainer devices to match."
                )
            return balance.validate_partition(self.partition, n_layers, n_stages)
        if self.partition == "params":
            return balance.partition(self.layer_param_counts, n_stages, method="params")
        return balance.partition([1.0] * n_layers, n_stages, method="uniform")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ----------------------------------------------------------------------------------------------------------------
    # Steps
    # ----------------------------------------------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            self._check_batch_sizes(trainer.train_dataloader, train=True)

    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            self._check_batch_sizes(trainer.val_dataloaders)

    def _check_batch_sizes(self, loaders: Any, *, train: bool = False) -> None:
        """Refuse a dataloader whose batches cannot split into micro-batches before any process runs a step."""
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            size = getattr(loader, "batch_size", None)
            if isinstance(size, int):
                self._check_batch_size(size, self._n_parts if train else 1)

    @property
    def _n_parts(self) -> int:
        """Into how many parts this replica's shard's training batches are split (1 unless replicas were grown)."""
        return self._parts[self.dp_rank][1] if self._parts else 1

    def _check_batch_size(self, size: int, n_parts: int) -> None:
        if size % n_parts:
            raise ValueError(
                f"A batch of {size} samples does not split into the {n_parts} replicas that share it (released "
                "processes joined as data-parallel replicas). Use batches that are full (drop_last=True) and a "
                "multiple of the replicas times strategy.n_microbatches."
            )
        if (size // n_parts) % self.n_microbatches:
            raise micro_batch_error(size // n_parts, self.n_microbatches)

    def _batch(self, batch: Any, *, train: bool = False) -> tuple[Any, Tensor]:
        inputs, target = split_batch(self.lightning_module, batch)
        size = first_dim(inputs)
        part, n_parts = self._parts[self.dp_rank] if self._parts and train else (0, 1)
        self._check_batch_size(size, n_parts)
        if train:
            self._batch_size = size
        if n_parts > 1:
            # This replica's contiguous part of the training batch its shard delivered (see `shrink`). Evaluation
            # batches are not split: replicas of one shard evaluate the same batch, which weighs equally in the mean.
            n = size // n_parts
            inputs, target = apply_to_collection((inputs, target), Tensor, lambda t: t.narrow(0, part * n, n))
        return inputs, target

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self.runtime is not None and self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        inputs, target = self._batch(batch, train=True)
        module = self.lightning_module
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        start = time.perf_counter()
        with self._in_phase(f"training step {module.trainer.global_step} (pipeline schedule)"):
            with self.precision_plugin.train_step_context():
                result = self.runtime.step(inputs, target, train=True)
            self._ties.reduce_grads(self._slots, self.runtime.plan, self.pp_rank)
            self.schedule_seconds = time.perf_counter() - start
            loss = self._share_loss(result.loss)
        if self.dp_group is not None:
            with self._in_phase(f"training step {module.trainer.global_step} (gradient all-reduce over replicas)"):
                self._average_over_replicas(params, loss)
                self._sync_replica_buffers()
        # Lightning zeroes gradients between `training_step` and `backward`: park them until `backward`.
        self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._pending_grads:
            p.grad = None
        module.log("train_loss", loss, prog_bar=True, on_step=True, batch_size=first_dim(inputs))
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._pending_grads:
            p.grad = grad if p.grad is None else p.grad + grad
        self._pending_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
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
        assert self.runtime is not None
        inputs, target = self._batch(args[0] if args else kwargs["batch"])
        with self._in_phase("prediction (pipeline forward)"), self.precision_plugin.predict_step_context():
            result = self.runtime.step(inputs, target, train=False)
            payload = [move_data_to_device(result.output, "cpu") if self.runtime.has_last_stage else None]
            dist.broadcast_object_list(payload, src=self._last_global_rank(), group=self.pp_group)
        return payload[0]

    def _eval_step(self, prefix: str, batch: Any) -> Tensor:
        assert self.runtime is not None and self.lightning_module is not None
        inputs, target = self._batch(batch)
        with self._in_phase(f"{'validation' if prefix == 'val' else prefix} (pipeline forward)"):
            result = self.runtime.step(inputs, target, train=False)
            loss = self._share_loss(result.loss)
        module = self.lightning_module
        size = first_dim(inputs)
        # Every process holds the same value; syncing makes Lightning's epoch mean explicit (and cheap).
        module.log(f"{prefix}_loss", loss, prog_bar=True, on_step=False, on_epoch=True, batch_size=size, sync_dist=True)
        if not target.is_floating_point():
            # Perplexity over all target tokens of the epoch; only the last stage has logits, the others add
            # nothing to the metric's sums, and torchmetrics sums them over processes when it computes.
            metric = self._perplexity(prefix)
            if self.runtime.has_last_stage:
                logits = result.output[0] if isinstance(result.output, tuple) else result.output
                metric.update(logits.float(), target)
            module.log(
                f"{prefix}_ppl",
                metric,
                on_step=False,
                on_epoch=True,
                batch_size=size,
                metric_attribute=f"_dynmo_{prefix}_ppl",
            )
        return loss

    def _perplexity(self, prefix: str) -> Any:
        if prefix not in self._eval_metrics:
            from torchmetrics.text import Perplexity

            assert self.runtime is not None
            if not self.runtime.has_last_stage:
                # Expected here: this process contributes zero counts and never calls `update`.
                warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric Perplexity")
            self._eval_metrics[prefix] = Perplexity().to(self.root_device)
        return self._eval_metrics[prefix]

    def _last_global_rank(self) -> int:
        assert self.runtime is not None
        last = self.runtime.last_rank
        return dist.get_global_rank(self.pp_group, last) if self.pp_group is not None else last

    def _average_over_replicas(self, params: list[Tensor], loss: Tensor) -> None:
        """Average gradients (and the logged loss) over the replicas, as DDP does: the mean over the global batch.

        A parameter may have no gradient in one replica and one in another (an expert no token of this replica was
        routed to): it gets a zero gradient where it has none, unless it has none anywhere (then it stays ``None``,
        as in a single process).
        """
        group, n = self.dp_group, self.dp_size
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self.root_device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
        grads = []
        for p, anywhere in zip(params, has.tolist(), strict=True):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
            if anywhere:
                grads.append(p.grad)
        # One flat buffer per dtype: one collective instead of one per parameter.
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for tensors in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(n)
            for g, reduced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True):
                g.copy_(reduced)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
        loss.div_(n)

    def _sync_replica_buffers(self) -> None:
        """Average the persistent floating-point buffers that differ between replicas (exactly kept where equal).

        Dynamic layers adapt buffers to the data they see (e.g. a sparse attention's density): without this, the
        replicas would drift apart; with it they follow the mean, as one replica seeing the global batch would.
        """
        assert self._slots is not None
        buffers = [
            t
            for i in self._slots.local_indices()
            for t in self._slots.get(i).state_dict(keep_vars=True).values()
            if not isinstance(t, torch.nn.Parameter) and t.is_floating_point()
        ]
        if not buffers:
            return
        group, n = self.dp_group, self.dp_size
        flat = torch._utils._flatten_dense_tensors([b.detach() for b in buffers]).float()
        low, high, total = flat.clone(), flat.clone(), flat.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        if torch.equal(low, high):
            return
        merged = torch.where(low == high, flat, total / n)
        with torch.no_grad():
            for b, value in zip(buffers, torch._utils._unflatten_dense_tensors(merged, buffers), strict=True):
                b.copy_(value.to(b.dtype))

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds bit-identical parameters and persistent buffers (collective over the job)."""
        module = self.lightning_module
        assert module is not None
        ok = True
        if self.dp_group is not None:
            digest = hashlib.sha256()
            for name, t in sorted(module.state_dict().items()):
                digest.update(name.encode())
                digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            found: list[Any] = [None] * self.dp_size
            dist.all_gather_object(found, digest.hexdigest(), group=self.dp_group)
            ok = len(set(found)) == 1
        flag = torch.tensor([1 if ok else 0], device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _share_loss(self, loss: Tensor | None) -> Tensor:
        """Broadcast the last stage's loss so every process logs (and returns) the same value."""
        out = loss.detach().float().clone() if loss is not None else torch.zeros((), device=self.root_device)
        out = out.to(self.root_device)
        dist.broadcast(out, src=self._last_global_rank(), group=self.pp_group)
        return out

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip by the norm of *all* stages' gradients, computed exactly as the unsplit model's clipping would.

        ``torch.nn.utils.clip_grad_norm_`` takes the norm of the per-parameter norms in optimizer order. Each stage
        computes its per-parameter norms the same way, all stages exchange them, and every stage stacks them in the
        unsplit model's order (group, then parameter position), so the clip coefficient is bit-identical to P=1.
        """
        position = {name: i for i, name in enumerate(self._param_order)}
        names = self._param_names()
        params, keys = [], []
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    keys.append((g, position[names[id(p)]]))
        grads = [p.grad for p in params]
        if grads and grads[0].device.type == "cpu":
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]  # torch's own CPU path
        else:
            norms = list(torch._foreach_norm(grads, 2.0)) if grads else []
        gathered: list[Any] = [None] * self.pp_size
        dist.all_gather_object(gathered, list(zip(keys, [float(n) for n in norms], strict=True)), group=self.pp_group)
        # A tied parameter's copies report the same key (and value): count it once, as the unsplit model does.
        merged = {key: norm for part in gathered for key, norm in part}
        ordered = [merged[key] for key in sorted(merged)]
        if not params:
            return
        dtype = grads[0].dtype
        total = torch.linalg.vector_norm(torch.tensor(ordered, dtype=dtype, device=grads[0].device), 2.0)
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)

    # ----------------------------------------------------------------------------------------------------------------
    # Rebalancing: measure, then move layers (both collective over the pipeline)
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def layers_per_stage(self) -> list[int]:
        """The current partition."""
        assert self.runtime is not None
        return list(self.runtime.plan.layers_per_stage)

    @property
    def n_layers(self) -> int:
        """Number of pipeline layers of the model."""
        assert self._slots is not None
        return self._slots.n_layers

    def request_profile(self) -> None:
        """Profile the coming training step (callbacks call this in ``on_train_batch_start``; several may)."""
        assert self.runtime is not None
        if not self.runtime.profiler.active:
            self.runtime.profiler.start()
            self._profiled = None

    def profile_results(self) -> dict[int, dict[str, float]] | None:
        """Every layer's measured costs of the step just profiled (collective), or ``None`` if it was not profiled.

        The first caller after the step stops the profiler and gathers; later callers get the same result.
        """
        assert self.runtime is not None
        if self.runtime.profiler.active:
            self._profiled = self.gather_costs(self.runtime.profiler.stop())
        return self._profiled

    def gather_costs(self, local: dict[int, LayerCost]) -> dict[int, dict[str, float]]:
        """Share this process's measured layer costs and memory with all stages; returns every layer's.

        Args:
            local: :meth:`LayerProfiler.stop` of this process.
        """
        assert self._slots is not None
        optimizer = self.optimizers[0] if self.optimizers else None
        mine = {}
        for i, cost in local.items():
            params, grads, optim = static_memory(self._slots.get(i), optimizer)
            mine[i] = {**dataclasses.asdict(cost), "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim}
        parts: list[Any] = [None] * self.pp_size
        dist.all_gather_object(parts, mine, group=self.pp_group)
        costs = {i: v for part in parts for i, v in part.items()}
        if self.dp_group is not None:
            # Replicas measure different data (routing, exits): average them, in replica order, so that every
            # process of the job holds the same numbers and plans the same partition.
            replicas: list[Any] = [None] * self.dp_size
            dist.all_gather_object(replicas, costs, group=self.dp_group)
            costs = {i: {k: sum(r[i][k] for r in replicas) / len(replicas) for k in costs[i]} for i in sorted(costs)}
        return costs

    def on_layers_changed(self) -> None:
        """Rebuild stages and schedules before the next step (called on every process by dynamics callbacks).

        Layers that stopped (or started) training change which stage boundaries carry gradients, which the stages'
        static metadata encodes; the next step probes again.
        """
        if self.runtime is not None:
            self.runtime.invalidate()

    def repartition(self, layers_per_stage: list[int]) -> MigrationStats:
        """Move layers so that the pipeline runs ``layers_per_stage`` (every process must call it with the same plan).

        Layers move with their parameters, buffers, flags, attributes and optimizer state; the stages, schedule and
        optimizer parameter groups are rebuilt. The math of training does not change.
        """
        assert self.runtime is not None and self._slots is not None and self.lightning_module is not None
        lps = balance.validate_partition(layers_per_stage, self.n_layers, self.n_stages)
        new = StagePlan(tuple(lps), self.pp_size)
        if new == self.runtime.plan:
            return MigrationStats(moves=[])
        with self._in_phase(f"layer migration {self.layers_per_stage} -> {lps}"):
            stats = migrate(
                self._slots,
                self._raw_optimizers(),
                self.runtime.plan,
                new,
                rank=self.pp_rank,
                group=self.pp_group,
                device=self.root_device,
            )
            self._ties.retie(self._slots, self._raw_optimizers())
            self._ties.prepare(new)
            self._ties.check_shapes(self._slots, new, self.pp_rank, self._raw_optimizers())
        self.runtime.set_plan(new)
        self.partitions.append({"step": self.lightning_module.trainer.global_step, "layers_per_stage": lps})
        return stats

    def shrink(self, keep_ranks: list[int], layers_per_stage: list[int], *, on_release: str = "exit") -> MigrationStats:
        """Consolidate every pipeline replica onto pipeline ranks ``keep_ranks``; release the others (collective).

        Layers move onto the kept ranks (exactly, with their state); then every process leaves the default process
        group and the survivors start a new one among themselves, replica by replica, in the order of
        ``keep_ranks``. Lightning's view follows: world size and ranks come from a
        :class:`~dynmo_lightning.pipeline.groups.ResizedEnvironment`. A released process leaves ``trainer.fit`` with
        ``SystemExit(0)``: at once (``on_release="exit"``), or when training ends (``"wait"``: it idles, holding no
        layers, until rank 0 tears down).

        With ``on_release="data_parallel"`` the processes a replica frees form new replicas of the smaller pipeline
        instead, as many whole pipelines as they make: they receive a copy of every layer (weights, optimizer and
        dynamic state) from the replica they came from, and the replicas that came from one split its batches into
        equal parts. The global batch, and so the learning-rate/batch-size relation the user configured, stays as it
        is; each step's work is divided among more processes. Processes left over are released (they exit).

        Args:
            keep_ranks: current pipeline ranks that keep running, ascending, starting with 0 (rank 0 logs and
                checkpoints, it is never released).
            layers_per_stage: the partition over the kept ranks.
            on_release: ``"exit"``, ``"wait"`` or ``"data_parallel"``.
        """
        assert self.runtime is not None and self._slots is not None and self.cluster_environment is not None
        if on_release not in ON_RELEASE:
            raise ValueError(f"balancer.on_release={on_release!r} is not one of {list(ON_RELEASE)}")
        if self.stages_per_rank != 1:
            raise ValueError("consolidation needs one stage per rank (strategy.stages_per_rank=1)")
        if not keep_ranks or keep_ranks[0] != 0 or sorted(set(keep_ranks)) != keep_ranks:
            raise ValueError(f"keep_ranks={keep_ranks} must be ascending, distinct and start with rank 0")
        lps = balance.validate_partition(layers_per_stage, self.n_layers, len(keep_ranks))
        old_rank, old_size, me = self.pp_rank, self.pp_size, self.global_rank
        # Every process must derive the same new layout: agree on the batch size it splits first.
        self._batch_size = self.broadcast(self._batch_size)
        replicas, shards, parts, copies = self._regroup(keep_ranks, on_release)
        world_port, control_port, heartbeat_port = share_ports(3)
        target = [0] * old_size
        for stage, rank in enumerate(keep_ranks):
            target[rank] = lps[stage]
        with self._in_phase(f"consolidation onto pipeline ranks {keep_ranks} (layer migration)"):
            stats = migrate(
                self._slots,
                self._raw_optimizers(),
                self.runtime.plan,
                StagePlan(tuple(target), old_size),
                rank=old_rank,
                group=self.pp_group,
                device=self.root_device,
            )
        if copies:
            with self._in_phase(f"consolidation: copying layers to {len(replicas) - self.dp_size} new replicas"):
                copied = replicate(self._slots, self._raw_optimizers(), copies, rank=me, device=self.root_device)
            stats.bytes_sent += copied.bytes_sent
            stats.bytes_received += copied.bytes_received
            stats.seconds += copied.seconds
        with self._in_phase("consolidation (end of the old process group)"):
            dist.barrier()
        # The old world's heartbeats end with it (released processes fall silent on purpose).
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self.runtime.invalidate()
        dist.destroy_process_group()
        address = self.cluster_environment.main_address
        timeout = self._timeout
        order = [rank for replica in replicas for rank in replica]
        if me not in order:
            self._release(address, control_port, "exit" if on_release == "data_parallel" else on_release)
        new_rank = order.index(me)
        if new_rank == 0 and on_release == "wait":
            self._control = control_store(address, control_port, is_master=True, timeout=timeout)
        restart_world(
            address=address,
            port=world_port,
            rank=new_rank,
            world_size=len(order),
            backend=self._process_group_backend or "gloo",
            timeout=timeout,
            device=self.root_device,
        )
        self.cluster_environment = ResizedEnvironment(self.cluster_environment, len(order), new_rank, world_port)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self._shards, self._parts = shards, parts
        self._build_mesh([[order.index(r) for r in replica] for replica in replicas])
        self._start_watchdog(heartbeat_port)
        self.runtime.rank = self.pp_rank
        self.runtime.group = self.pp_group
        self.runtime.set_plan(StagePlan(tuple(lps), len(keep_ranks)))
        self._ties.retie(self._slots, self._raw_optimizers())
        self._ties.prepare(self.runtime.plan, new_world=True)
        assert self.lightning_module is not None
        self.partitions.append({"step": self.lightning_module.trainer.global_step, "layers_per_stage": lps})
        return stats

    def _regroup(
        self, keep_ranks: list[int], on_release: str
    ) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The replicas after a repack onto ``keep_ranks`` (old global ranks), their shards and batch parts.

        Also the ``(src, dst)`` layer copies that make the new replicas.
        """
        replicas: list[list[int]] = []
        shards: list[tuple[int, int]] = []
        parts: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        p = len(keep_ranks)
        for d, ranks in enumerate(self._replicas):
            kept = [ranks[r] for r in keep_ranks]
            freed = [rank for r, rank in enumerate(ranks) if r not in keep_ranks]
            part, n_parts = self._parts[d]
            k = 1
            if on_release == "data_parallel":
                k = 1 + len(freed) // p
                # As many replicas as divide the batch evenly (into whole micro-batches each).
                while k > 1 and not self._splits_into(n_parts * k):
                    k -= 1
            for j in range(k):
                replica = kept if j == 0 else freed[(j - 1) * p : j * p]
                replicas.append(replica)
                shards.append(self._shards[d])
                parts.append((part * k + j, n_parts * k))
                if j:
                    copies += list(zip(kept, replica, strict=True))
        return replicas, shards, parts, copies

    def _splits_into(self, n_parts: int) -> bool:
        size = self._batch_size
        if size is None or size % n_parts or (size // n_parts) % self.n_microbatches:
            if size is not None:
                rank_zero_warn(
                    f"on_release='data_parallel': a batch of {size} samples does not split into {n_parts} parts of "
                    f"whole micro-batches (strategy.n_microbatches={self.n_microbatches}); fewer released processes "
                    "become replicas (the rest exit)."
                )
            return False
        return True

    def _release(self, address: str, control_port: int, on_release: str) -> None:
        """End this process's part in training: it holds no layers any more (it sent them all)."""
        self.runtime = None
        self._pending_grads = []
        gc.collect()
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()
        if on_release == "wait":
            store = control_store(address, control_port, is_master=False, timeout=_RELEASED_WAIT)
            store.wait([SHUTDOWN_KEY], _RELEASED_WAIT)
        raise SystemExit(0)

    # ----------------------------------------------------------------------------------------------------------------
    # Collectives (over the whole job, as Lightning expects)
    # ----------------------------------------------------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with self._in_phase(f"a barrier ({name or 'Lightning'})"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        payload = [obj]
        with self._in_phase("a broadcast"):
            dist.broadcast_object_list(payload, src, group=_group.WORLD)
        return payload[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            with self._in_phase("a reduction of logged values"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: one file with the unsplit model's keys, optimizer state by parameter name
    # ----------------------------------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights are loaded after the split so each process reads only its own layers.
        return True

    def _param_names(self) -> dict[int, str]:
        """``id(param) -> name`` in the unsplit model (a tied parameter's copies all get the tie's canonical name)."""
        assert self.lightning_module is not None
        return {id(p): self._ties.canonical(name) for name, p in self.lightning_module.named_parameters()}

    def param_norm(self) -> float:
        """L2 norm (float64) of all parameters of the unsplit model, across stages (collective).

        Each stage sums its own parameters; a tied parameter, held by several stages, is counted once.
        """
        assert self.runtime is not None and self.lightning_module is not None
        sq = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for name, p in self.lightning_module.named_parameters():
            if self._ties.counted_here(name, self.runtime.plan, self.pp_rank):
                sq += p.detach().to(torch.float64).square().sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.pp_group)
        return math.sqrt(float(sq))

    def tie_layers(self, param: Tensor) -> set[int]:
        """Indices of all pipeline layers sharing ``param`` (a local parameter) in the unsplit model; empty if none."""
        assert self.lightning_module is not None
        name = next((n for n, p in self.lightning_module.named_parameters() if p is param), None)
        return self._ties.layers_of(name) if name is not None else set()

    def _raw_optimizers(self) -> list[Optimizer]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if hasattr(optimizer, "_optimizer"):  # LightningOptimizer
            optimizer = optimizer._optimizer
        return named_optimizer_state(optimizer, self._param_names())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self.dp_rank != 0:
            return  # replicas are identical: the first one writes
        part = move_data_to_device(
            {"state_dict": checkpoint.get("state_dict", {}), "optimizer_states": checkpoint.get("optimizer_states")},
            "cpu",
        )
        parts: list[Any] | None = [None] * self.pp_size if self.pp_rank == 0 else None
        with self._in_phase(f"checkpoint save ({os.fspath(filepath)})"):
            dist.gather_object(part, parts, dst=self._global_rank_of_pp(0), group=self.pp_group)
        if parts is None:
            return
        checkpoint = dict(checkpoint)
        state_dict: dict[str, Any] = {}
        for p in parts:
            state_dict.update(p["state_dict"])
        checkpoint["state_dict"] = state_dict
        if parts[0]["optimizer_states"] is not None:
            checkpoint["optimizer_states"] = [
                merge_named_optimizer_states([p["optimizer_states"][i] for p in parts])
                for i in range(len(parts[0]["optimizer_states"]))
            ]
        checkpoint["dynmo"] = {
            "partitions": self.partitions,
            "world_size": self.world_size,
            # How the data was divided: sampler shards, and the replicas that split each shard's batches.
            "data_parallel_size": self._shards[0][1] if self._shards else 1,
            "replicas": self.dp_size,
        }
        if self.is_global_zero:
            _atomic_save(self.checkpoint_io, checkpoint, filepath, storage_options)

    def _global_rank_of_pp(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank) if self.pp_group is not None else pp_rank

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(
                f"ckpt_path={os.fspath(checkpoint_path)} is not a readable checkpoint ({type(e).__name__}: {e}); it "
                "may be truncated or not a Lightning checkpoint. Resume from an earlier one (checkpoints are written "
                "to a temporary file and renamed, so the previous one is always complete)."
            ) from e
        if "state_dict" not in checkpoint:
            raise ValueError(f"ckpt_path={os.fspath(checkpoint_path)} has no 'state_dict': not a training checkpoint")
        saved = checkpoint.get("dynmo", {})
        shards, replicas = saved.get("data_parallel_size", 1), saved.get("replicas", 1)
        if replicas != shards and replicas != self.dp_size:
            rank_zero_warn(
                f"{os.fspath(checkpoint_path)} was written by {replicas} replicas that split the batches of "
                f"{shards} data shard(s) (released processes had become replicas). This job runs {self.dp_size} "
                f"replica(s) with data.batch_size per replica: to keep the global batch of the saved run, use "
                f"strategy.data_parallel_size={replicas} and divide data.batch_size by {replicas // max(shards, 1)}."
            )
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        saved = checkpoint["state_dict"]
        local = module.state_dict().keys()
        missing = [k for k in local if k not in saved]
        unexpected = [k for k in saved if k not in self._global_keys]
        if strict and (missing or unexpected):
            raise RuntimeError(
                "The checkpoint does not match the model: "
                f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. "
                "Was it written for a different model configuration?"
            )
        try:
            module.load_state_dict({k: saved[k] for k in local if k in saved}, strict=strict)
        except RuntimeError as e:
            details = [line.strip() for line in str(e).splitlines()[1:]]
            more = f" and {len(details) - 3} more" if len(details) > 3 else ""
            raise RuntimeError(
                f"The checkpoint does not match the model ({'; '.join(details[:3])}{more}). Was it written for a "
                "different model configuration?"
            ) from e

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        names = self._param_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(local_optimizer_state(saved, optimizer, names))
            from lightning.fabric.utilities.optimizer import _optimizer_to_device

            _optimizer_to_device(optimizer, self.root_device)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._control is not None:
            self._control.set(SHUTDOWN_KEY, "1")  # processes released with on_release="wait" may exit now
        module = self._lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Set-up failed before the split: meta tensors cannot move to CPU (and hold no memory), so keep the base
            # teardown from trying; it would mask the original error.
            self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DynMo pipeline parallelism (torch.distributed.pipelining)"
        )


def _atomic_save(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any
) -> None:
    """Write to a temporary file in the same directory, then rename: a crash never leaves a half-written checkpoint."""
    path = os.fspath(filepath)
    tmp = f"{path}.tmp-{os.getpid()}"
    checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
    os.replace(tmp, path)
