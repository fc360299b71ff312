"""Run ``torch.distributed.pipelining`` schedules over the stages a partition defines.

Planning (which layers form which stage) is separate from running: :class:`StagePlan` is the pure description, and
:class:`PipelineRuntime` builds ``PipelineStage`` objects and a schedule from it, lazily and again after every change.

Activation shapes are discovered by a *probe*: the first micro-batch is pushed through the stages once, in stage order,
with the real layers (under :func:`~dynmo_lightning.protocol.probing`, with the RNG state forked), and the observed
input/output shapes, dtypes and ``requires_grad`` flags are handed to ``PipelineStage`` as static metadata. Static
metadata makes the schedule skip its own runtime inference, which would run extra forward and backward passes through
the user's layers on every (re)build and every train/eval switch. The probe carries real activations from stage to
stage (device to device, their shapes on the CPU control group): what a dynamic layer returns may depend on the
values it gets (early exit's active-token mask decides which branch runs and whether an auxiliary loss needs
gradients), so a stand-in of zeros could record other metadata.

Training and evaluation keep separate metadata, each probed once until the layers change. Evaluation stages and
schedules are built when an evaluation runs and dropped when training resumes: they hold a receive buffer per
micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
)

from dynmo_lightning.balance.split.placement import V_SCHEDULES, stage_ranks
from dynmo_lightning.core.context import probing
from dynmo_lightning.core.layer_calls import as_tuple
from dynmo_lightning.core.model import may_leave_parameters_unused, needs_whole_backward
from dynmo_lightning.pipeline import transport
from dynmo_lightning.pipeline.compiled import is_compiled
from dynmo_lightning.pipeline.layers import LayerSlots, StageModule
from dynmo_lightning.pipeline.layout import PipelineGroup
from dynmo_lightning.pipeline.sharding import StageSharding
from dynmo_lightning.profiling import LayerProfiler
from dynmo_lightning.recompute import Policy

#: What ``DynMoStrategy(schedule=...)`` accepts (the keys of :data:`SCHEDULES`).
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]

#: Schedule names accepted by :class:`PipelineRuntime` (and ``DynMoStrategy(schedule=...)``).
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

#: Schedules that split each backward into its input part and its weight part (zero-bubble: the weight part fills
#: the bubbles). Their weight part sets ``.grad`` itself, past DDP's hooks: replicas need ``data_parallel="fsdp"``
#: or ``"replicate"``, whose reduction the pipeline stage runs itself after the last weight pass.
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")

#: Schedules that run several stages per rank (torch's multi-stage schedules).
MULTI_STAGE = ("interleaved_1f1b", *SPLIT_BACKWARD)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Contiguous layers per (virtual) stage and the stage-to-rank mapping of the schedule.

    The placement is :func:`~dynmo_lightning.balance.split.placement.stage_ranks` of ``schedule``: looped schedules run
    stage ``s`` on rank ``s % n_ranks`` (one stage per rank, or ``k`` interleaved ones with ``k * n_ranks`` stages), the
    V schedules (``"zbv"``, ``"dualpipev"``) stages ``s`` and ``2 n_ranks - 1 - s`` on rank ``s``.
    """

    layers_per_stage: tuple[int, ...]
    n_ranks: int
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if self.n_stages % self.n_ranks:
            raise ValueError(f"{self.n_stages} stages do not spread evenly over {self.n_ranks} ranks")

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The pipeline rank of every stage."""
        return tuple(stage_ranks(self.schedule, self.n_ranks, self.n_stages // self.n_ranks))

    def with_layers(self, layers_per_stage: Sequence[int]) -> StagePlan:
        """The same placement with another split."""
        return dataclasses.replace(self, layers_per_stage=tuple(layers_per_stage))

    @property
    def n_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.layers_per_stage)

    @property
    def n_layers(self) -> int:
        """Number of layers in the model."""
        return sum(self.layers_per_stage)

    def bounds(self, stage: int) -> tuple[int, int]:
        """Layer index range ``[start, end)`` of ``stage``."""
        start = sum(self.layers_per_stage[:stage])
        return start, start + self.layers_per_stage[stage]

    def rank_of_stage(self, stage: int) -> int:
        """Pipeline rank that runs ``stage``."""
        return self.ranks[stage]

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stages run by pipeline ``rank``, in order."""
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def layers_of_rank(self, rank: int) -> list[int]:
        """Layer indices held by pipeline ``rank``, in order."""
        return [i for s in self.stages_of_rank(rank) for i in range(*self.bounds(s))]

    def rank_of_layer(self, index: int) -> int:
        """Pipeline rank that holds layer ``index``."""
        end = 0
        for stage, n in enumerate(self.layers_per_stage):
            end += n
            if index < end:
                return self.rank_of_stage(stage)
        raise IndexError(f"layer {index} out of range for {self.n_layers} layers")


@dataclasses.dataclass
class StepResult:
    """What one schedule step produced on this rank (loss and output only on the last stage's rank)."""

    loss: Tensor | None
    output: Any = None


class PipelineRuntime:
    """Builds and runs the pipeline of this rank's stages.

    Args:
        slots: the layers of the model (local ones real, remote ones placeholders).
        plan: the partition into stages.
        pipe: this process's pipeline (its rank, group and members).
        device: where this rank's layers live.
        schedule: a key of :data:`SCHEDULES`.
        n_microbatches: micro-batches per step.
        loss_fn: ``(output, target) -> loss`` of one micro-batch (the module's ``pipeline_loss``).
        recompute: which layers run under activation checkpointing (``None``: none); asked whenever stages are
            built, so the answer follows each layer wherever it moves.
        sharding: how the stages share their layers with their replicas (``None``: DDP over :attr:`replicas`).

    """

    def __init__(
        self,
        slots: LayerSlots,
        plan: StagePlan,
        *,
        pipe: PipelineGroup,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[Any, Tensor], Tensor],
        recompute: Policy | None = None,
        sharding: StageSharding | None = None,
    ) -> None:
        self.profiler = LayerProfiler(device)
        self.sharding = sharding if sharding is not None else StageSharding("ddp", lambda: None, device)
        self.recompute = recompute
        self.slots = slots
        self.plan = plan
        self.pipe = pipe
        self.device = device
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self._built: dict[bool, tuple[Any, list[PipelineStage]]] = {}
        self._metas: dict[bool, list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]] = {}
        #: Data-parallel replicas of this pipeline (their process group), set by the strategy; ``None``: one replica.
        self.replicas: dist.ProcessGroup | None = None
        #: The replicas' CPU group (host data between them), set with :attr:`replicas`.
        self.replicas_host: dist.ProcessGroup | None = None
        # What the training stages were wrapped for: the replica group and each stage's trainable parameters.
        self._wrapped_for: tuple[Any, list[list[int]]] | None = None
        # Where an evaluation step hands each last-stage micro-batch output (see `step`).
        self._each_output: Callable[[Any, Tensor], None] | None = None

    # ------------------------------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self.pipe.rank

    @property
    def local_stages(self) -> list[int]:
        """Stages run by this rank."""
        return self.plan.stages_of_rank(self.rank)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank feeds the batch inputs."""
        return 0 in self.local_stages

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return self.plan.n_stages - 1 in self.local_stages

    @property
    def last_rank(self) -> int:
        """Pipeline rank of the last stage."""
        return self.plan.rank_of_stage(self.plan.n_stages - 1)

    @property
    def last_global_rank(self) -> int:
        """Global rank of the process running the last stage (it has the loss and the outputs)."""
        return self.pipe.global_rank(self.last_rank)

    def set_plan(self, plan: StagePlan, pipe: PipelineGroup | None = None) -> None:
        """Adopt a new partition (the caller has already moved the layers), on a new pipeline group if given.

        Stages are rebuilt on the next step.
        """
        self.plan = plan
        if pipe is not None:
            self.pipe = pipe
        self.invalidate()

    def invalidate(self) -> None:
        """Forget built stages, schedules and metadata (layers or their shapes changed); rebuilt on the next step."""
        self._built.clear()
        self._metas.clear()

    def stage_modules(self) -> list[StageModule]:
        """The modules of this rank's stages, built from the currently installed layers."""
        modules = []
        for stage in self.local_stages:
            start, end = self.plan.bounds(stage)
            layers = [self.slots.get(i) for i in range(start, end)]
            policy = self.recompute
            chosen = [i for i, layer in enumerate(layers, start) if policy is not None and policy(i, layer)]
            modules.append(StageModule(layers, start, self.profiler, chosen, self.schedule_name in SPLIT_BACKWARD))
        return modules

    # ------------------------------------------------------------------------------------------------------------
    def step(
        self,
        inputs: Any,
        target: Tensor,
        *,
        train: bool,
        outputs: bool = True,
        each_output: Callable[[Any, Tensor], None] | None = None,
    ) -> StepResult:
        """Run one schedule step on a whole batch: forward (and backward when ``train``) of every micro-batch.

        Gradients of the local parameters accumulate in ``.grad`` scaled to the mean over micro-batches.
        Returns the mean micro-batch loss on the last stage's rank (``None`` elsewhere); when not training, also the
        merged last-stage output, unless ``outputs`` is false (then no micro-batch's output is kept past its loss).
        ``each_output(output, target)``, when given, sees each last-stage micro-batch's output of an evaluation.
        """
        inputs = as_tuple(inputs)
        if train:
            self._built.pop(False, None)  # evaluation is over: free its stages' receive buffers
            if train in self._built and self._wrapped_for != self._wrap_key():
                # The replicas or the trainable parameters changed: new DDP wrappers (and requires_grad flags).
                del self._built[train], self._metas[train]
        if train not in self._built:
            self._built[train] = self._build(inputs, target, train)
        schedule, _ = self._built[train]
        losses: list[Tensor] = []
        args = inputs if self.has_first_stage else ()
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.has_last_stage else {}
        if train:
            output = schedule.step(*args, return_outputs=False, **kwargs)
            if not schedule.scale_grads:
                _divide_grads(self._built[train][1], self.n_microbatches)
        else:
            self._each_output = each_output
            try:
                output = schedule.eval(*args, return_outputs=outputs, **kwargs)
            finally:
                self._each_output = None
            self.sharding.reshard(stage.submod for stage in self._built[train][1])
        if not self.has_last_stage:
            return StepResult(loss=None)
        loss = torch.stack([x.detach().float() for x in losses]).mean()
        return StepResult(loss=loss, output=None if train else output)

    def _eval_loss(self, output: Any, target: Tensor) -> Tensor:
        """The evaluation schedule's loss of one micro-batch, which also hands the output to :meth:`step`'s caller."""
        if self._each_output is not None:
            self._each_output(output, target)
        return self.loss_fn(output, target)

    # ------------------------------------------------------------------------------------------------------------
    def _build(self, inputs: tuple[Any, ...], target: Tensor, train: bool) -> tuple[Any, list[PipelineStage]]:
        # Buffers made here are reused by every later step; inference tensors would break in-place receives
        # outside inference mode, so build with inference mode off.
        with torch.inference_mode(False):
            if train not in self._metas:
                self._metas[train] = self._probe(inputs, train)
            metas = self._metas[train]
            stages = [
                _Stage(
                    self.profiler,
                    lambda: self.replicas_host,
                    self.sharding,
                    self.sharding.wrap(module, self.replicas if train else None),
                    stage,
                    self.plan.n_stages,
                    self.device,
                    input_args=in_meta,
                    output_args=out_meta,
                    group=self.pipe.group,
                )
                for module, stage, (in_meta, out_meta) in zip(
                    self.stage_modules(), self.local_stages, metas, strict=True
                )
            ]
        if train:
            self._wrapped_for = self._wrap_key()
        cls = SCHEDULES[self.schedule_name]
        loss_fn = self.loss_fn if train else self._eval_loss
        if issubclass(cls, PipelineScheduleMulti):
            # torch divides each stage's gradients by the micro-batches when that stage's backwards are done: a
            # parameter two local stages share (a tie of the first and last stage under the V) would be divided
            # twice, once between the two stages' contributions. Such gradients are divided once, in `step`.
            scale = not _shares_parameters(stages)
            schedule = cls(stages, self.n_microbatches, loss_fn=loss_fn, scale_grads=scale)
            if not train and self.schedule_name in V_SCHEDULES:
                _forward_only(schedule)
        else:
            schedule = cls(stages[0], self.n_microbatches, loss_fn=loss_fn, scale_grads=True)
        return schedule, stages

    def _wrap_key(self) -> tuple[Any, list[list[int]]]:
        """The replica group and the ids of each local stage's trainable parameters (what a DDP wrapper holds).

        DDP (:meth:`StageSharding.wrap`) runs every micro-batch but the last under ``no_sync`` and lets its reducer
        all-reduce bucket by bucket during the last backward (``PipelineStage.backward_maybe_with_nosync``).
        """
        if self.replicas is None or self.sharding.units:
            # nothing is wrapped in DDP: no per-step walk over the parameters (FSDP2 follows requires_grad itself,
            # and which parameter objects a unit registers changes as it gathers and frees them)
            return None, []
        layers = [[self.slots.get(i) for i in range(*self.plan.bounds(stage))] for stage in self.local_stages]
        return self.replicas, [[id(p) for layer in ls for p in layer.parameters() if p.requires_grad] for ls in layers]

    def _probe(self, inputs: tuple[Any, ...], train: bool) -> list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]:
        """Push the first micro-batch through all stages in order and record each local stage's tensor metadata.

        A stage on another rank gets the activations' shapes, dtypes and ``requires_grad`` flags on the control group
        and the activations themselves device to device (:mod:`~dynmo_lightning.pipeline.transport`).
        Returns, per local stage, (input metas, output metas) as meta-device tensors carrying ``requires_grad``.
        """
        first_mb = split_args_kwargs_into_chunks(inputs, None, self.n_microbatches)[0][0]
        modules = dict(zip(self.local_stages, self.stage_modules(), strict=True))
        metas = []
        carry: tuple[Tensor, ...] | None = None
        grad_ctx = torch.enable_grad if train else torch.no_grad
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), probing():
            for stage in self.local_stages:
                if stage == 0:
                    x = tuple(t.to(self.device) for t in first_mb)
                elif self.plan.rank_of_stage(stage - 1) == self.rank:
                    x = carry
                else:
                    x = self._recv_activations(stage - 1, train)
                with grad_ctx():
                    out = as_tuple(modules[stage](*x))
                metas.append((tuple(_meta(t) for t in x), tuple(_meta(t) for t in out)))
                if stage == self.plan.n_stages - 1:
                    continue
                if self.plan.rank_of_stage(stage + 1) == self.rank:
                    carry = tuple(t.detach().requires_grad_(t.requires_grad) for t in out)
                else:
                    self._send_activations(out, stage + 1)
        return metas

    def _send_activations(self, out: tuple[Tensor, ...], stage: int) -> None:
        peer = self._global(stage)
        transport.send_header([(t.dtype, tuple(t.shape), t.requires_grad) for t in out], peer, self.pipe)
        transport.send_tensors([t.detach().contiguous() for t in out], peer, self.pipe)

    def _recv_activations(self, stage: int, train: bool) -> tuple[Tensor, ...]:
        peer = self._global(stage)
        specs = transport.recv_header(peer, self.pipe)
        x = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape, _ in specs]
        transport.recv_tensors(x, peer, self.pipe)
        return tuple(t.requires_grad_(rg and train) for t, (_, _, rg) in zip(x, specs, strict=True))

    def _global(self, stage: int) -> int:
        """Global rank of the process running ``stage`` (p2p calls address global ranks)."""
        return self.pipe.global_rank(self.plan.rank_of_stage(stage))


def _unique_parameters(stages: Sequence[PipelineStage]) -> dict[int, nn.Parameter]:
    return {id(p): p for stage in stages for p in stage.submod.parameters()}


def _shares_parameters(stages: Sequence[PipelineStage]) -> bool:
    """Whether two of the local stages hold the same parameter (a tie kept as one tensor on this rank)."""
    return len(_unique_parameters(stages)) < sum(len(list(stage.submod.parameters())) for stage in stages)


def _divide_grads(stages: Sequence[PipelineStage], n_microbatches: int) -> None:
    """Mean over micro-batches of the summed gradients, once per parameter however many stages share it."""
    for p in _unique_parameters(stages).values():
        if p.grad is not None:
            p.grad.div_(n_microbatches)


def _forward_only(schedule: Any) -> None:
    """Keep only the forward actions of a V schedule's task order (for evaluation, which runs no backward).

    torch's ``eval`` runs the training order with the backward switched off, and its V schedules then fail where
    two adjacent stages share a rank ("can't steal_bwd_input if this stage doesn't have backward"). The forwards of
    a deadlock-free order, in that order, are deadlock-free too: each waits only on the forward before it.
    """
    order: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order.items():
        subs = [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))]
        forwards = [a for a in subs if a.computation_type == _ComputationType.FORWARD]
        order[rank] = _add_unshard_reshard(forwards)  # FSDP2 units gather before they compute (a no-op otherwise)
    # torch's own lowering to send/receive actions (its `_prepare_schedule_with_comms` would insist on backwards).
    ranks = schedule.stage_index_to_group_rank
    schedule.pipeline_order_with_comms = _add_send_recv(order, lambda s: ranks[s], schedule._num_stages)


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose split backward is exact on any stage and whose weight pass the profiler times.

    torch's input pass (``stage_backward_input``) finds the weights' part of the graph from the stage inputs'
    gradients; a later stage whose inputs carry none (the output of a frozen prefix) would get no weight gradients
    at all. torch runs its first stage's backward whole in the weight pass for that reason; here such a stage runs it
    whole at once (same gradients, no bubble filled) and its weight pass is empty.

    Under ``data_parallel="fsdp"`` or ``"replicate"`` torch's stage runs the reduction over the replicas after the
    last backward; before it, parameters another replica has a gradient for get a zero one here
    (:meth:`StageSharding.fill_unused_grads`).

    Args:
        profiler: the runtime's profiler.
        replicas_host: returns the replicas' CPU group (``None``: one replica).
        sharding: how the stage shares its layers with its replicas.
        *args: ``PipelineStage``'s arguments.
        **kwargs: ``PipelineStage``'s keyword arguments.
    """

    def __init__(
        self,
        profiler: LayerProfiler,
        replicas_host: Callable[[], dist.ProcessGroup | None],
        sharding: StageSharding,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._profiler = profiler
        self._replicas_host = replicas_host
        self._sharding = sharding
        self._done_whole: set[int] = set()
        # A compiled layer's backward is one AOTAutograd graph; a module may need its backward whole (core/model.py)
        self._whole = any(is_compiled(m) for m in self.submod.modules()) or needs_whole_backward(self.submod)

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        """The forward of one micro-batch; in evaluation the last stage then forgets the output.

        torch caches every output for the backward and the send; evaluation's last stage has neither, and its cache
        would hold all the batch's logits until the next step.
        """
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.is_last and not self.has_backward:
            self.fwd_cache[fwd_chunk_id] = ((), self.fwd_cache[fwd_chunk_id][1])  # nothing to send: no outputs
        return output

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]] | None]:
        """A micro-batch's backward; under ``fsdp_memory="lean"`` every unit reduce-scatters its gradient as it ends.

        torch's stage turns FSDP2's gradient sync off until the last micro-batch (whole gradients accumulate, one
        reduction per step); the lean way syncs and frees the gathered weights after every unit's backward, so a
        process holds one layer's whole gradient at a time, its shards otherwise. FSDP2 adds each reduction into the
        sharded gradient. Units whose backward hook does not fire (a first layer fed token ids) reduce in
        :meth:`perform_reduce_grad`, as under the fast way. So do units that may leave a parameter without a
        gradient (an MoE layer run expert by expert): replicas must reduce the same gradients, which the zero fill
        before the last reduction ensures (:meth:`StageSharding.fill_unused_grads`). Only whole backwards (a split
        one is refused at launch).
        """
        if not (self._sharding.lean and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        for unit in self.submod.modules():
            if isinstance(unit, FSDPModule) and may_leave_parameters_unused(unit):
                unit.set_requires_gradient_sync(False, recurse=False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """The sends of a micro-batch's input gradients; a ``None`` one a previous stage waits for is sent as zeros.

        An input whose gradient is ``None`` although it requires one (an input no loss depends on: MoE's carried
        auxiliary loss when its coefficient is 0) has a zero gradient. torch 2.13 skips it on both ends; torch 2.11
        (``PipelineStage`` without ``_get_grad_send_meta``) refuses it while the previous stage waits for it.
        """
        if not _SKIPS_NONE_GRADS and self.has_backward and not self.is_first:
            if self.grad_send_info is None:
                self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
            grads = self.bwd_cache[bwd_chunk_id]
            self.bwd_cache[bwd_chunk_id] = zero_missing_grads(grads, self.grad_send_info, self.args_recv_info[0])
        if self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
            # p2p sends need contiguous tensors; an input's gradient need not be one (MoE's scatter, a split backward)
            self.bwd_cache[bwd_chunk_id] = tuple(
                g.contiguous() if isinstance(g, Tensor) else g for g in self.bwd_cache[bwd_chunk_id]
            )
        return super().get_bwd_send_ops(bwd_chunk_id)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """The replicas' gradient reduction after the last backward (FSDP2 / replicate units)."""
        if self._sharding.units:
            self._sharding.fill_unused_grads(self.submod, self._replicas_host())
        super().perform_reduce_grad(grad_scale_factor)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        """Backward of micro-batch ``bwd_chunk_id``: its input part only, unless the inputs carry no gradient."""
        if not full_backward and not self.is_first and bwd_chunk_id in self.fwd_cache:
            inputs = self.fwd_cache[bwd_chunk_id][1]
            # no input gradient, a compiled layer, or a module that needs its backward whole: whole at once
            if self._whole or not any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
                full_backward = True
                self._done_whole.add(bwd_chunk_id)
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """The weight part of a split backward of micro-batch ``bwd_chunk_id``, timed when profiling."""
        if bwd_chunk_id in self._done_whole:
            self._done_whole.discard(bwd_chunk_id)
            return
        with self._profiler.weight_pass():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


#: Whether torch's pipeline stage itself skips an input gradient that is ``None`` (torch >= 2.12: it asks its metadata).
_SKIPS_NONE_GRADS = hasattr(PipelineStage, "_get_grad_send_meta")


def zero_missing_grads(grads: Sequence[Any], send_to: Sequence[Any], received: Sequence[Any]) -> tuple[Any, ...]:
    """``grads`` of a stage's inputs, a zero (the received input's shape) where one is ``None`` but a stage waits."""
    return tuple(
        torch.zeros_like(info.buffer) if grad is None and stage is not None else grad
        for grad, stage, info in zip(grads, send_to, received, strict=True)
    )


def _meta(t: Tensor) -> Tensor:
    """A meta-device stand-in with the shape, dtype and ``requires_grad`` of ``t`` (what PipelineStage records)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)


def check_schedule(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """Raise a clear ``ValueError`` when the schedule cannot run with these sizes (before any process waits)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"strategy.schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
    if n_microbatches < 1:
        raise ValueError(f"strategy.n_microbatches={n_microbatches} must be >= 1")
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        _check_interleaved(schedule, n_ranks, n_stages, n_microbatches)
    elif schedule in V_SCHEDULES:
        _check_v(schedule, n_ranks, n_stages, n_microbatches)
    elif n_stages != n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} runs one stage per rank; stages_per_rank > 1 needs one of "
            f"{list(MULTI_STAGE)}"
        )
    if schedule == "1f1b" and n_microbatches < n_ranks:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} < {n_ranks} pipeline ranks: 1F1B needs at least one "
            "micro-batch per stage; raise n_microbatches or use schedule='gpipe'"
        )


def _check_interleaved(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """The sizes torch's looped multi-stage schedules accept (interleaved 1F1B and interleaved zero-bubble)."""
    if n_ranks < 2:
        # torch's runtime cannot evaluate (forward only) adjacent stages that share a rank.
        raise ValueError(f"strategy.schedule={schedule!r} needs at least 2 processes; use '1f1b' on one")
    if n_stages == n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} needs several stages per rank: set "
            "strategy.stages_per_rank >= 2 (or use schedule='1f1b')"
        )
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} does not work with strategy.schedule={schedule!r} on "
            f"{n_ranks} ranks: it must be a multiple of n_microbatches // ranks = {rounds}; use a multiple of {n_ranks}"
        )


def _check_v(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """The sizes torch's V-shaped schedules accept (ZBV zero-bubble and DualPipeV): two stages per rank."""
    if n_ranks < 2:
        raise ValueError(f"strategy.schedule={schedule!r} needs at least 2 processes; use '1f1b' on one")
    if n_stages != 2 * n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} places exactly two stages on every rank in a V (stages s and "
            f"2P-1-s on rank s): set strategy.stages_per_rank=2, got {n_stages // n_ranks}"
        )
    if schedule == "dualpipev" and n_microbatches < n_stages:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} < {n_stages} stages: DualPipeV needs at least one "
            f"micro-batch per stage; set strategy.n_microbatches >= {n_stages} (2 x processes)"
        )


def first_dim(x: Any) -> int:
    """Batch size of a tensor or of the first tensor in a tuple."""
    return as_tuple(x)[0].shape[0]
