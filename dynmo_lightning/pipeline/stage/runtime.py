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
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
)
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
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.stage.schedules import SCHEDULES, SPLIT_BACKWARD
from dynmo_lightning.pipeline.stage.slots import LayerSlots, StageModule
from dynmo_lightning.pipeline.stage.torch_stage import _meta, _Stage
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.pipeline.topology.world import FixedWorld
from dynmo_lightning.profiling import LayerProfiler
from dynmo_lightning.recompute import Policy


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
        self.sharding = sharding if sharding is not None else StageSharding("ddp", FixedWorld(), device)
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
                    self,
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
        and the activations themselves device to device (:mod:`~dynmo_lightning.pipeline.topology.transport`).
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


def first_dim(x: Any) -> int:
    """Batch size of a tensor or of the first tensor in a tuple."""
    return as_tuple(x)[0].shape[0]
