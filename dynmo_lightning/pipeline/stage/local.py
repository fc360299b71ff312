"""The stages one process runs: the layers it holds, the schedule that runs them, and moving layers in and out.

:class:`LocalStages` is what the strategy delegates the model side of the pipeline to. It owns the split model
(:mod:`~dynmo_lightning.pipeline.stage.cut`: which layers live here, under which names), the ties between layers of
different stages (:mod:`~dynmo_lightning.pipeline.stage.ties`) and the schedule runtime
(:mod:`~dynmo_lightning.pipeline.stage.runtime`), and keeps the three consistent whenever layers move
(:mod:`~dynmo_lightning.pipeline.stage.migration`): after a re-partition, a consolidation, or a restart of the world.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dynmo_lightning.core.model import may_leave_parameters_unused
from dynmo_lightning.pipeline.parallel.compiled import check_options, compile_layer
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.parallel.tensor_parallel import average_replicated_grads
from dynmo_lightning.pipeline.stage import reduce
from dynmo_lightning.pipeline.stage.cut import count_params, initial_partition, pipeline_layers, split_module
from dynmo_lightning.pipeline.stage.evaluation import EvalOutput
from dynmo_lightning.pipeline.stage.migration import MigrationStats, migrate, pack
from dynmo_lightning.pipeline.stage.reshape import Change, rehome, reshape, whole
from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime, StagePlan, StepResult
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.stage.ties import TiedParameters
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.pipeline.topology.world import FixedWorld, StageWorld
from dynmo_lightning.profiling import calibration_seconds, release_cached_memory
from dynmo_lightning.recompute import Policy


class LocalStages:
    """This process's pipeline stages (see the module docstring).

    Args:
        module: the LightningModule, split in place (other stages' layers become placeholders).
        layers: its pipeline layers.
        plan: the first partition.
        world: the world in force (the ``World``): this process's pipeline, the job's layout and this pipeline's
            row in it (for the ties' groups).
        device: where this stage's layers live.
        seed: base seed of the per-layer initialisation.
        schedule: the schedule's name.
        n_microbatches: micro-batches per step.
        timeout: timeout of the ties' process groups.
        recompute: the layers under activation checkpointing (:func:`~dynmo_lightning.recompute.checkpoint_policy`).
        sharding: how the stages share their layers with their replicas (``None``: DDP).
        compile_options: ``strategy.compile``: false (eager), true, or ``torch.compile``'s options for every layer
            (``pipeline/compiled``).
    """

    def __init__(
        self,
        module: nn.Module,
        layers: list[nn.Module],
        plan: StagePlan,
        world: StageWorld,
        *,
        device: torch.device,
        seed: int,
        schedule: str,
        n_microbatches: int,
        timeout: timedelta,
        recompute: Policy | None = None,
        sharding: StageSharding | None = None,
        compile_options: bool | dict[str, Any] | None = None,
    ) -> None:
        self.module = module
        self.compile_options = check_options(compile_options)
        self.device = device
        sharding = sharding if sharding is not None else StageSharding("ddp", FixedWorld(), device)
        # Where processes hold parts of their layers, each is built as its parts (pipeline/split.build_in_parts).
        parts = self._apply_parts if sharding.units or sharding.tensor_parallel is not None else None
        self.sharding = sharding
        pipe = world.pipeline
        self.split = split_module(module, layers, plan, pipe.rank, device, seed, parts)
        self.ties = TiedParameters(self.split.ties, world, timeout)
        self.ties.follow(self.slots, plan, pipe.rank)
        self.ties.sync_values(self.slots, plan, pipe.rank)
        self.runtime = PipelineRuntime(
            self.slots,
            plan,
            pipe=pipe,
            device=device,
            schedule=schedule,
            n_microbatches=n_microbatches,
            loss_fn=module.pipeline_loss,
            recompute=recompute,
            sharding=sharding,
        )
        self._profiled: dict[int, dict[str, float]] | None = None
        self._pending: list[tuple[Tensor, Tensor]] = []
        self._changed: dict[int, set[int]] = {}  # optimizer steps done -> layers the dynamics changed
        #: ``(keep_ranks, layers_per_stage)`` of a consolidation whose layer moves are committed and whose new world
        #: is not adopted yet (a loss in between leaves the survivors there); ``None`` otherwise.
        self.packed: tuple[list[int], list[int]] | None = None

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        partition: str | list[int],
        world: StageWorld,
        *,
        stages_per_rank: int,
        schedule: str,
        n_microbatches: int,
        device: torch.device,
        timeout: timedelta,
        recompute: Policy | None = None,
        sharding: StageSharding | None = None,
        compile_options: bool | dict[str, Any] | None = None,
    ) -> LocalStages:
        """Split ``module`` with its first partition (``"uniform"``, ``"params"`` or a list; see pipeline/split).

        ``recompute`` chooses the layers under activation checkpointing (``None``: none), ``sharding`` how the
        replicas share the layers (``None``: DDP).
        """
        layers = pipeline_layers(module)
        pipe = world.pipeline
        kwargs = {"pp_size": pipe.size, "stages_per_rank": stages_per_rank, "n_microbatches": n_microbatches}
        lps = initial_partition(partition, count_params(layers), schedule=schedule, **kwargs)
        seed = int(getattr(module, "pipeline_init_seed", 0))
        plan = StagePlan(tuple(lps), pipe.size, schedule)
        return cls(
            module,
            layers,
            plan,
            world,
            device=device,
            seed=seed,
            schedule=schedule,
            n_microbatches=n_microbatches,
            timeout=timeout,
            recompute=recompute,
            sharding=sharding,
            compile_options=compile_options,
        )

    @property
    def slots(self) -> LayerSlots:
        """Where every layer sits in the module, and which ones this process holds."""
        return self.split.slots

    def shard(self) -> None:
        """Split, compile and make units of every local layer that is not yet (tensor parallel, compile, FSDP2).

        The layers that arrived by migration are split and units already (compiled here); layers the processes of a
        stage hold whole are compiled here.

        Before the optimizers see the parameters; torchtitan's order: tensor parallel, compile, then FSDP.
        """
        indices = self.slots.local_indices()
        for i in indices:
            self._apply_parts(i, self.slots.get(i))
        # a tie kept as one tensor on this process would be managed by two units: refused here
        self.sharding.shard_layers([self.slots.get(i) for i in indices])

    def _apply_parts(self, index: int, layer: nn.Module) -> None:
        """Split, compile and make a unit of layer ``index`` (real or meta), each unless it is already."""
        self.sharding.split(index, layer)
        if self.compile_options is not None:
            compile_layer(layer, self.compile_options)
        self.sharding.make_unit(layer)

    @property
    def plan(self) -> StagePlan:
        """The partition in force."""
        return self.runtime.plan

    @property
    def pipe(self) -> PipelineGroup:
        """This process's pipeline."""
        return self.runtime.pipe

    # ----------------------------------------------------------------------------------------------------------------
    def train(
        self, inputs: Any, target: Tensor, params: Sequence[Tensor], replicas: Any = None, replicas_host: Any = None
    ) -> Tensor:
        """Forward and backward of every micro-batch into the ``.grad`` of ``params``; the loss on every process.

        With data-parallel ``replicas`` (their process group; ``replicas_host`` its CPU twin), gradients are averaged
        over them during or after the last micro-batch's backward
        (:mod:`~dynmo_lightning.pipeline.parallel.data_parallel`). The copies of a tie held by several stages get the
        sum of their gradients, as the unsplit model's one tensor.

        Gradients start from nothing: set to ``None``, except where DDP keeps them in its buckets
        (``gradient_as_bucket_view``): there they are zeroed in place, so that every micro-batch accumulates into the
        buckets (a ``None`` gradient makes autograd allocate a fresh one, which the reducer then copies into its
        bucket, and the ``no_sync`` micro-batches accumulate beside the buckets). Not for layers that may leave a
        parameter without a gradient (an MoE layer run expert by expert): a zero gradient would make the optimizer
        step a parameter that one process without replicas leaves alone.
        """
        in_buckets = self._bucket_grads(replicas)
        for p in params:
            if p.grad is not None and id(p) in in_buckets:
                p.grad.zero_()
            else:
                p.grad = None
        self.runtime.replicas, self.runtime.replicas_host = replicas, replicas_host
        result = self.runtime.step(inputs, target, train=True)
        average_replicated_grads([self.slots.get(i) for i in self.slots.local_indices()], self.sharding.tensor_parallel)
        self.ties.reduce_grads(self.slots, self.plan, self.pipe.rank)
        return reduce.share_loss(result.loss, self.pipe, self.runtime.last_rank)

    def _bucket_grads(self, replicas: Any) -> set[int]:
        """Ids of the parameters whose gradients DDP over ``replicas`` keeps in its buckets and always gives one."""
        if replicas is None or self.sharding.units:
            return set()
        layers = [self.slots.get(i) for i in self.slots.local_indices()]
        return {id(p) for layer in layers if not may_leave_parameters_unused(layer) for p in layer.parameters()}

    def average_replicas(self, loss: Tensor, group: Any, n: int, host_group: Any) -> None:
        """Average the logged loss and data-adapted buffers over ``n`` replicas (gradients: see :meth:`train`).

        ``host_group`` is ``group``'s CPU twin (host values of buffers are averaged there).
        """
        reduce.average_loss(loss, group, n)
        reduce.sync_replica_buffers(self.slots, group, n, host_group)

    def park_grads(self, params: Sequence[Tensor]) -> None:
        """Take the gradients off ``params`` until :meth:`restore_grads` (Lightning zeroes them in between)."""
        self._pending = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._pending:
            p.grad = None

    def restore_grads(self) -> None:
        """Put the parked gradients back (added to any gradient accumulated meanwhile)."""
        for p, grad in self._pending:
            p.grad = grad if p.grad is None else p.grad + grad
        self._pending = []

    def predict(self, inputs: Any, target: Tensor) -> Any:
        """The last stage's outputs (on the CPU) on every process of the pipeline (over its CPU control group)."""
        result = self.runtime.step(inputs, target, train=False)
        payload = [move_data_to_device(result.output, "cpu") if self.runtime.has_last_stage else None]
        dist.broadcast_object_list(payload, src=self.runtime.last_global_rank, group=self.pipe.control)
        return payload[0]

    def evaluate(self, inputs: Any, target: Tensor) -> tuple[Tensor, StepResult]:
        """Forward of every micro-batch; the loss on every process, and on the last stage what it kept of the batch.

        The result's ``output`` is an :class:`~dynmo_lightning.pipeline.stage.evaluation.EvalOutput` there (``None``
        elsewhere): the token sums of every micro-batch, and the merged outputs only where the module's
        ``pipeline_eval_step`` needs them.
        """
        kept = EvalOutput.of(self.module)
        result = self.runtime.step(inputs, target, train=False, outputs=kept.keeps_outputs, each_output=kept.add)
        kept.output = result.output
        loss = reduce.share_loss(result.loss, self.pipe, self.runtime.last_rank)
        return loss, dataclasses.replace(result, output=kept if self.runtime.has_last_stage else None)

    def request_profile(self) -> None:
        """Profile the coming step (several callers may ask; the step is measured once)."""
        if not self.runtime.profiler.active:
            self.runtime.profiler.start()
            self._profiled = None

    def profile_results(
        self, optimizer: Optimizer | None, replicas: tuple[Any, int] | None
    ) -> dict[int, dict[str, float]] | None:
        """Every layer's costs of the step just profiled, from all stages (collective), or ``None``.

        The first caller after the step stops the profiler and gathers; later callers get the same result.
        """
        if self.runtime.profiler.active:
            local = self.runtime.profiler.stop()
            probe = calibration_seconds(self.device)  # this process's speed now, beside its layers' times
            self._profiled = reduce.gather_costs(local, self.slots, optimizer, self.pipe, replicas, self.sharding,
                                                 probe)  # fmt: skip
        return self._profiled

    def layers_changed(self, step: int, layers: Sequence[int] | None) -> None:
        """Dynamics changed ``layers`` (``None``: any) while ``step`` steps were done: rebuild, and remember them."""
        self.runtime.invalidate()
        self._changed = {s: c for s, c in self._changed.items() if s >= step - 1}  # callbacks read the last two
        self._changed.setdefault(step, set()).update(range(self.slots.n_layers) if layers is None else layers)

    def changed_layers(self, step: int) -> list[int]:
        """The layers reported changed while ``step`` steps were done."""
        return sorted(self._changed.get(step, ()))

    # ----------------------------------------------------------------------------------------------------------------
    def migrate(
        self, new: StagePlan, optimizers: Sequence[Optimizer], job: Any = None, job_wide: bool = False
    ) -> MigrationStats:
        """Move layers to partition ``new`` with all their state (collective over the pipeline).

        ``job_wide``: commit together with every process of ``job``, the whole job's CPU group
        (``pipeline/stage/migration.migrate``), not only the pipeline's.

        The built stages go first: their buffers (a receive buffer per micro-batch, DDP's gradient buckets) are not
        held while layers travel. After the commit the memory of the layers that left goes back to the device
        (:func:`release_cached_memory`): the caching allocator would otherwise keep their blocks, fragmenting across
        moves.
        """
        self._drop_stages()
        args = (self.slots, optimizers, self.plan, new)
        stats = migrate(*args, pipe=self.pipe, sharding=self.sharding, job=job, job_wide=job_wide)
        self.ties.follow(self.slots, new, self.pipe.rank, optimizers)
        self.shard()  # arrived units are units again; a tie they would share on this process is refused here
        self.runtime.set_plan(new)
        release_cached_memory(self.device)  # the layers that left: their blocks back to the device
        return stats

    def set_lean(self, lean: bool) -> None:
        """Run FSDP2 units the lean way (``fsdp_memory="lean"``) or the fast way from the next step on."""
        self.runtime.invalidate()  # stage roots are made again with the next schedule
        self.sharding.set_lean(lean, (self.slots.get(i) for i in self.slots.local_indices()))

    @contextlib.contextmanager
    def whole_layer(self, index: int) -> Iterator[nn.Module]:
        """Within: local layer ``index`` whole, to read (a copy if it is held in parts: collective over its groups)."""
        with whole(self.slots.get(index), self.device) as layer:
            yield layer

    def reshape_layer(self, index: int, change: Change, optimizers: Sequence[Optimizer]) -> None:
        """Apply ``change`` to local layer ``index`` whole, with its optimizer state (``pipeline/stage/reshape.py``).

        Collective over the layer's replica and tensor-parallel groups when it is held in parts; the stages are
        built again before the next step.
        """
        self._drop_stages()
        reshape(self.slots, index, change, optimizers, self.device, self._apply_parts)

    def _drop_stages(self) -> None:
        """Forget the built stages before layers move: their buffers, and the root the units ran under, go."""
        self.runtime.invalidate()
        self.sharding.forget_root(self.slots.get(i) for i in self.slots.local_indices())

    def pack(
        self,
        keep_ranks: list[int],
        layers_per_stage: list[int],
        copies: list[tuple[int, int]],
        optimizers: Sequence[Optimizer],
        job: Any,
        job_wide: bool = False,
    ) -> MigrationStats:
        """Move every layer onto pipeline ranks ``keep_ranks`` and copy them to new replicas (before a restart).

        ``job`` is the CPU group of the whole job, over which the copies are agreed, and the moves too where
        ``job_wide`` (``pipeline/stage/migration.migrate``).
        """
        self._drop_stages()  # as in :meth:`migrate`
        args = (self.slots, optimizers, self.plan, keep_ranks, layers_per_stage, copies)
        stats = pack(*args, pipe=self.pipe, job=job, sharding=self.sharding, job_wide=job_wide)
        self.packed = (list(keep_ranks), list(layers_per_stage))
        release_cached_memory(self.device)
        return stats

    def adopt(
        self,
        plan: StagePlan,
        pipe: PipelineGroup,
        optimizers: Sequence[Optimizer],
        copies: Mapping[int, Callable[[DTensor], Tensor]] | None = None,
    ) -> None:
        """Run ``plan`` on ``pipe`` of a new world (layers already packed; the ties get new groups).

        Layers held in parts are made parts again on the new world's meshes first (``pipeline/reshape.rehome``:
        collective over every stage group of the new world), from the ``copies`` of lost places' parts where a loss
        left them (``pipeline/elastic/mirror.py``).
        """
        self._drop_stages()
        self.packed = None
        rehome(self.slots, optimizers, self.device, self.sharding, self._apply_parts, copies)
        self.shard()  # compiled again where a layer was taken apart
        self.runtime.set_plan(plan, pipe)
        self.ties.follow(self.slots, plan, pipe.rank, optimizers, new_world=True)

    # ----------------------------------------------------------------------------------------------------------------
    def param_names(self) -> dict[int, str]:
        """``id(param) -> name`` in the unsplit model (a tied parameter's copies all get the tie's canonical name)."""
        return {id(p): self.ties.canonical(name) for name, p in self.module.named_parameters()}

    def param_norm(self, shards: Sequence[Any] = (), holders: int = 1) -> float:
        """L2 norm (float64) of all parameters of the unsplit model, across stages; tied ones counted once.

        ``shards``: the groups over which the ``holders`` processes of a stage hold parts of its parameters (FSDP2's
        replicas, the tensor-parallel group).
        """
        plan, rank = self.plan, self.pipe.rank
        named = list(self.module.named_parameters())
        counted = lambda n: self.ties.counted_here(n, plan, rank)  # noqa: E731
        return reduce.param_norm(named, counted, self.pipe, shards, holders)

    def tie_layers(self, param: Tensor) -> set[int]:
        """Indices of all pipeline layers sharing ``param`` (a local parameter) in the unsplit model; empty if none."""
        name = next((n for n, p in self.module.named_parameters() if p is param), None)
        return self.ties.layers_of(name) if name is not None else set()


@dataclasses.dataclass(frozen=True)
class LayerEditor:
    """The strategy's role for callbacks that change layers' shapes (:class:`~dynmo_lightning.protocol.LayerEditing`).

    Attributes:
        stages: this process's stages (the layers, their parts, how they are made).
        optimizers: the optimizers holding the layers' parameters (their state changes with them).
        unit_multiple: what prunable unit counts stay a multiple of (the tensor-parallel size).
    """

    stages: LocalStages
    optimizers: Sequence[Optimizer]
    unit_multiple: int

    def whole_layer(self, index: int) -> contextlib.AbstractContextManager[nn.Module]:
        """Within: local layer ``index`` whole, to read (collective over its groups if held in parts)."""
        return self.stages.whole_layer(index)

    def reshape_layer(self, index: int, change: Change) -> None:
        """Apply ``change(layer, optimizers)`` to local layer ``index`` whole, then make it parts again."""
        self.stages.reshape_layer(index, change, self.optimizers)
