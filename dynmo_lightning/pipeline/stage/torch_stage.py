"""The ``PipelineStage`` the runtime gives torch's schedules: static metadata, missing gradients zeroed.

Its sends are made sendable (contiguous, not views) where torch's split backward or FSDP2 would hand it otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
)
from torch.distributed.pipelining._backward import stage_backward

from dynmo_lightning.core.model import may_leave_parameters_unused, needs_whole_backward
from dynmo_lightning.pipeline.parallel.compiled import is_compiled
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.profiling import LayerProfiler


class ReplicasHost(Protocol):
    """What a stage reads of its runtime at the end of a step: the replicas' CPU group in force."""

    replicas_host: dist.ProcessGroup | None


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
        runtime: the runtime running the stage; its ``replicas_host`` is the replicas' CPU group now (``None``: one
            replica).
        sharding: how the stage shares its layers with its replicas.
        *args: ``PipelineStage``'s arguments.
        **kwargs: ``PipelineStage``'s keyword arguments.
    """

    def __init__(
        self,
        profiler: LayerProfiler,
        runtime: ReplicasHost,
        sharding: StageSharding,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._profiler = profiler
        self._runtime = runtime
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
            self._sharding.fill_unused_grads(self.submod, self._runtime.replicas_host)
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
