"""Every layer's bytes as the memory model needs them, measured one layer at a time on fake tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from dynmo_lightning.balance.steptime.memory_model import LayerBytes
from dynmo_lightning.bench.memory_emulator import (
    Sharded,
    before_backward,
    build_stage,
    fake_replicas,
    fake_tensors,
    hookless_tracker,
    reduce_gradients,
    tracked_bytes,
)
from dynmo_lightning.bench.memory_stacks import Stack
from dynmo_lightning.core.layer_calls import as_tuple
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.stage.slots import StageModule
from dynmo_lightning.profiling import LayerCost, LayerProfiler, static_memory


def layer_bytes(stack: Stack, recompute: bool = False, sharded: Sharded | None = None) -> list[LayerBytes]:
    """Every layer's bytes as the model needs them, measured one layer at a time on fake tensors.

    Parameters, gradients and AdamW state from the tensors' sizes; the bytes a layer keeps for backward per
    micro-batch (and, checkpointed, what its recomputation holds) from the project's profiler, as a profiled step
    reports them to the balancer; its input's and output's bytes from the activations; and, tracked by
    ``MemTracker``, what its backward allocates at its peak as a step's first, again, and as a split backward's input
    part (:attr:`LayerBytes.workspace`, :attr:`LayerBytes.workspace_again`, :attr:`LayerBytes.workspace_input`) and
    what a micro-batch holds more between a split backward's input and weight parts (:attr:`LayerBytes.split_extra`).

    ``sharded``: every layer an FSDP2 unit (:class:`Sharded`). Its computation is measured on the unit as it runs the
    fast way (in FSDP2's compute dtype); what FSDP2 holds of it is priced as the balancer prices it: this process's
    shards of its weights and AdamW state (``static_memory``), and the gradients, gathered weights and per-layer
    transient of :meth:`~dynmo_lightning.pipeline.parallel.data_parallel.StageSharding.step_bytes` under the setting
    measured.
    """
    out = []
    with fake_replicas(sharded, stack.autocast) as sharding, fake_tensors(stack):
        fast = None if sharding is None else dataclasses.replace(sharding, lean=False)
        x, target = stack.microbatch()
        for i in range(stack.n_layers):
            layer, y = _one_layer_bytes(stack, i, x, target, recompute, fast)
            out.append(layer if sharding is None else _as_unit(stack, i, layer, sharding))
            x = tuple(t.detach() for t in as_tuple(y))
    return out


def _as_unit(stack: Stack, i: int, layer: LayerBytes, sharding: StageSharding) -> LayerBytes:
    """Layer ``i``'s bytes as an FSDP2 unit holds it under ``sharding``, priced as the balancer prices it.

    ``layer`` was measured on the unit (its shards' bytes in ``params`` and ``grads``); the step's gradients,
    gathered weights and transient follow ``sharding``'s setting (:func:`layer_bytes`).
    """
    unit = stack.layer(i)
    sharding.shard_layers([unit])
    step = sharding.step_bytes(unit)
    # AdamW: two moments of every trained shard; no autocast casts (FSDP2 gathers the weights in the compute dtype)
    return dataclasses.replace(layer, grads=step["grad_bytes"], optim=2 * layer.grads,
                               copies=step.get("weight_copies_bytes", layer.copies),
                               gathered=step.get("gathered_bytes", 0.0), cast_grads=0.0)  # fmt: skip


def _one_layer_bytes(
    stack: Stack, i: int, x: Any, target: Tensor, recompute: bool, sharding: StageSharding | None = None
) -> tuple[LayerBytes, Any]:
    """Layer ``i``'s bytes (see :func:`layer_bytes`) from its input ``x``; with the output its profiled step made.

    Args:
        stack: the model.
        i: the layer.
        x: the layer's input (the previous layer's output, detached; the micro-batch's input for the first).
        target: the micro-batch's target (the last layer's loss takes it).
        recompute: the layer under activation checkpointing.
        sharding: the layer an FSDP2 unit, measured as it computes in the fast way (its weights gathered, whole
            gradients accumulated); what FSDP2 holds of it is priced by :func:`_as_unit`.

    Returns:
        The layer's :class:`LayerBytes` and its output (the next layer's input).
    """
    profiler = LayerProfiler(torch.device("cpu"))
    stage = build_stage(stack, range(i, i + 1), recompute, profiler, sharding)
    x = tuple(t.detach().requires_grad_(t.is_floating_point() and i > 0) for t in as_tuple(x))
    params, grads, _ = static_memory(stage, None)
    y, cost = _profiled_step(stack, stage, profiler, i, x, target)
    last = i == stack.n_layers - 1
    loss_target = target if last else None  # the loss only on the last layer
    first, again = _backward_peaks(stage, x, loss_target, stack, sharding)
    made = grads if sharding is None else sharding.step_bytes(stage.layers[0])["grad_bytes"]  # whole, accumulated
    # (activation checkpointing does not run under the split backward: strategy.activation_checkpointing)
    split = i > 0 and not recompute and sharding is None
    input_part, split_extra = _split_backward(stage, x, loss_target, stack) if split else (None, 0.0)
    activations = cost.activation_bytes + (_loss_held(y, target, stack) if last else 0)
    inputs = sum(t.numel() * t.element_size() for t in x if t.is_floating_point())
    # every weight copy of a plain layer is autocast's cast: its gradient is the copy's size (LayerBytes.cast_grads)
    layer = LayerBytes(params, grads, 2 * grads, activations, cost.recompute_bytes, inputs, first - made, split_extra,
                       cost.weight_copies_bytes, cast_grads=cost.weight_copies_bytes, workspace_again=again,
                       workspace_input=input_part, outputs=_size(y))  # fmt: skip
    return layer, y


def _profiled_step(
    stack: Stack, stage: StageModule, profiler: LayerProfiler, i: int, x: tuple[Tensor, ...], target: Tensor
) -> tuple[Any, LayerCost]:
    """One forward and backward of layer ``i`` under the profiler: its output and the cost the profiler reports."""
    last = i == stack.n_layers - 1
    profiler.start()  # a whole forward and backward, as a profiled step (a recomputation shows its casts)
    y = stage(*x)
    ends = [stack.loss(y, target)] if last else list(as_tuple(y))
    stage_backward(ends[0] if last else ends, None if last else [torch.empty_like(t) for t in ends], list(x))
    cost = profiler.stop()[i]
    for p in stage.parameters():
        p.grad = None
    return y, cost


def _outputs(stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack) -> tuple[list, list | None]:
    y = stage(*x)
    if target is not None:
        return [stack.loss(y, target)], None
    outs = list(as_tuple(y))
    return outs, [torch.empty_like(t) for t in outs]


def _loss_held(y: Any, target: Tensor, stack: Stack) -> int:
    """What the loss of one micro-batch keeps for backward (the last stage holds it with the head's activations)."""
    tracker = hookless_tracker()
    tracker.track_external(*as_tuple(y))
    base = tracked_bytes(tracker, "current")
    with tracker:
        loss = stack.loss(y, target)
        held = tracked_bytes(tracker, "current") - base
    del loss
    return held


def _size(y: Any) -> int:
    """Bytes of the tensors of a layer's output."""
    return sum(t.numel() * t.element_size() for t in as_tuple(y) if isinstance(t, Tensor))


def _backward_peaks(
    stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack, sharding: StageSharding | None
) -> tuple[int, int]:
    """The most a layer's whole backward holds at once above what its forward left: as a step's first, and again.

    The forward is tracked too, so that what the backward frees of it (its activations) offsets what it allocates,
    as in the stage. The first backward (its gradients included, made by it) runs from a forward that casts the
    weights anew, as a stage's first micro-batch does; the second adds to the gradients the first made, from a
    forward that finds the casts in autocast's cache, as every later micro-batch of a step does
    (:attr:`LayerBytes.cast_grads`).
    """
    torch.clear_autocast_cache()
    peaks = []
    for _ in range(2):
        tracker = hookless_tracker()
        tracker.track_external(stage, *x)  # the layer's weights and gradients, its input
        with tracker:
            out, grads = _outputs(stage, x, target, stack)
        with tracker:  # entered again: the peak starts from here
            before = tracked_bytes(tracker, "current")
            before_backward(stage, sharding)
            stage_backward(out[0] if grads is None else out, grads, list(x))
            peaks.append(tracked_bytes(tracker, "peak") - before)
        del out, grads
    reduce_gradients(stage)  # FSDP2's accumulated gradients to the shards, then gone
    for p in stage.parameters():
        p.grad = None
    return peaks[0], peaks[1]


def _split_backward(stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack) -> tuple[int, int]:
    """A split backward's input part: the most it holds above what its forward left, and what it leaves more."""
    tracker = hookless_tracker()
    tracker.track_external(stage, *x)
    with tracker:
        out, grads = _outputs(stage, x, target, stack)
    with tracker:  # entered again: the peak starts from here
        after_forward = tracked_bytes(tracker, "current")
        _, pending = stage_backward_input(out, grads, list(x), stage.parameters())
        peak = tracked_bytes(tracker, "peak") - after_forward
        for t in x:
            t.grad = None  # sent on (and freed) by the stage
        after_input = tracked_bytes(tracker, "current")
        stage_backward_weight(stage.parameters(), pending)
    for p in stage.parameters():
        p.grad = None
    return peak, after_input - after_forward
