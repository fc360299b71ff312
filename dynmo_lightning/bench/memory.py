"""Every stage's memory at real sizes without a GPU: the schedule's own task order run on fake tensors, tracked.

One truth the memory model (:mod:`dynmo_lightning.balance.steptime.memory_model`) is checked against (the other is
real processes: :mod:`~dynmo_lightning.bench.memory_runs`). For one pipeline rank at a time, its stages are built at
full size under ``FakeTensorMode`` (fake CPU tensors: nothing is allocated; byte counts do not depend on the device),
with the receive buffers torch's ``PipelineStage`` keeps (one input and one output-gradient buffer per micro-batch)
and AdamW with its state; then one training step runs the rank's tasks in the order of the schedule
(:func:`~dynmo_lightning.balance.steptime.makespan.rank_orders`) with torch's own backward functions
(``stage_backward``, and ``stage_backward_input`` / ``stage_backward_weight`` for the zero-bubble schedules' split
backward), the stage keeping every micro-batch's output until its backward as torch's does, and the optimizer step;
torch's ``MemTracker`` reports the peak. Layers run through the project's
:class:`~dynmo_lightning.pipeline.layers.StageModule`, so activation checkpointing is the runtime's. Under FSDP2
(:class:`Sharded`) the process is one replica of a fake process group: its layers are real units over it, driven as
the pipeline stage drives them (gradient sync off until the reduction after the last backward, or every micro-batch
reducing under ``fsdp_memory="lean"``).

The same layers measured one at a time (:func:`layer_bytes`, with the project's profiler) give the model its inputs:
parameters, gradients, optimizer state, what a layer keeps for backward per micro-batch, its input's and output's
sizes, and what its backward holds at its peak (measured here: the balancer's own path has no such measurement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torch.testing._internal.distributed.fake_pg import FakeStore

from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import rank_orders
from dynmo_lightning.balance.steptime.memory_model import LayerBytes, MemoryModel, additive
from dynmo_lightning.core.layer_calls import as_tuple
from dynmo_lightning.core.parts import fsdp_param_groups
from dynmo_lightning.pipeline.layers import StageModule
from dynmo_lightning.pipeline.sharding import StageSharding
from dynmo_lightning.profiling import LayerCost, LayerProfiler, static_memory


@dataclasses.dataclass
class Stack:
    """A model as the emulator builds it: its layers one by one, its micro-batch input and loss.

    Attributes:
        n_layers: pipeline layers.
        layer: builds layer ``i`` (called under ``FakeTensorMode``).
        microbatch: the first layer's input of one micro-batch, and its target.
        loss: ``(last layer's output, target) -> loss``.
        autocast: run forward and backward under bf16 autocast (``precision="bf16-mixed"``).
    """

    n_layers: int
    layer: Callable[[int], nn.Module]
    microbatch: Callable[[], tuple[tuple[Tensor, ...], Tensor]]
    loss: Callable[[Any, Tensor], Tensor]
    autocast: bool = False


@dataclasses.dataclass(frozen=True)
class Sharded:
    """FSDP2 in every stage (``data_parallel="fsdp"``) over ``replicas`` processes, emulated by one of them.

    The process joins a fake process group of ``replicas`` ranks (``torch.testing``'s ``FakeStore``: it is rank 0,
    collectives return at once) and its stages' layers become units over it as the strategy makes them
    (:class:`~dynmo_lightning.pipeline.sharding.StageSharding`): the shards, the gathered weights, the
    reduce-scatter's buffers are allocated as on a real replica.

    Attributes:
        replicas: processes sharing each stage (``D``).
        lean: ``fsdp_memory="lean"``.
    """

    replicas: int
    lean: bool = False


@contextlib.contextmanager
def _replicas(sharded: Sharded | None, autocast: bool) -> Iterator[StageSharding | None]:
    """Within: the sharding of ``sharded`` over a fake process group (see :class:`Sharded`); ``None``: none."""
    if sharded is None:
        yield None
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sharded.replicas)
    try:
        mesh = init_device_mesh("cpu", (sharded.replicas,), mesh_dim_names=("dp",))
        param_dtype = torch.bfloat16 if autocast else None  # bf16-mixed: FSDP2 computes in bf16, as the strategy's
        yield StageSharding("fsdp", lambda: mesh, torch.device("cpu"), param_dtype, lean=sharded.lean)
    finally:
        dist.destroy_process_group()


class _Modules:
    """Stands in for ``MemTracker``'s module tracker: no hooks on modules.

    The module tracker attributes memory to modules through autograd hooks on their inputs and outputs, which
    torch's split backward (``autograd.grad`` over leaf inputs) refuses; the tracker's storage accounting and its
    peak, which are what this measures, do not need them (every byte counts as one kind then).
    """

    is_bw = False
    parents: tuple[str, ...] = ("Global",)

    def register_user_hooks(self, *hooks: Any) -> None:
        """No module hooks."""

    def clear_user_hooks(self) -> None:
        """No module hooks."""

    def __enter__(self) -> _Modules:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def _tracker() -> MemTracker:
    tracker = MemTracker()
    tracker._mod_tracker = _Modules()  # type: ignore[assignment]  # see _Modules
    return tracker


@contextlib.contextmanager
def _fake(stack: Stack) -> Iterator[None]:
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=stack.autocast):
        yield


def _stage(
    stack: Stack,
    layers: range,
    recompute: bool,
    profiler: LayerProfiler | None = None,
    sharding: StageSharding | None = None,
) -> StageModule:
    """A stage of ``layers``; with ``sharding``, every layer a unit and the stage their root (as ``wrap`` makes it)."""
    torch.manual_seed(0)
    modules = [stack.layer(i) for i in layers]
    stage = StageModule(modules, layers.start, profiler, frozenset(layers) if recompute else frozenset())
    if sharding is not None:
        sharding.shard_layers(modules)
        sharding.wrap(stage, None)
    return stage


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
    transient of :meth:`~dynmo_lightning.pipeline.sharding.StageSharding.step_bytes` under the setting measured.
    """
    out = []
    with _replicas(sharded, stack.autocast) as sharding, _fake(stack):
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
    stage = _stage(stack, range(i, i + 1), recompute, profiler, sharding)
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
    tracker = _tracker()
    tracker.track_external(*as_tuple(y))
    base = _total(tracker, "current")
    with tracker:
        loss = stack.loss(y, target)
        held = _total(tracker, "current") - base
    del loss
    return held


def _size(y: Any) -> int:
    """Bytes of the tensors of a layer's output."""
    return sum(t.numel() * t.element_size() for t in as_tuple(y) if isinstance(t, Tensor))


def _total(tracker: MemTracker, kind: str) -> int:
    return max((sum(v for k, v in snap.items() if k != "Total") for snap in tracker.get_tracker_snapshot(kind)
                .values()), default=0)  # fmt: skip


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
        tracker = _tracker()
        tracker.track_external(stage, *x)  # the layer's weights and gradients, its input
        with tracker:
            out, grads = _outputs(stage, x, target, stack)
        with tracker:  # entered again: the peak starts from here
            before = _total(tracker, "current")
            _before_backward(stage, sharding)
            stage_backward(out[0] if grads is None else out, grads, list(x))
            peaks.append(_total(tracker, "peak") - before)
        del out, grads
    _reduce(stage)  # FSDP2's accumulated gradients to the shards, then gone
    for p in stage.parameters():
        p.grad = None
    return peaks[0], peaks[1]


def _split_backward(stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack) -> tuple[int, int]:
    """A split backward's input part: the most it holds above what its forward left, and what it leaves more."""
    tracker = _tracker()
    tracker.track_external(stage, *x)
    with tracker:
        out, grads = _outputs(stage, x, target, stack)
    with tracker:  # entered again: the peak starts from here
        after_forward = _total(tracker, "current")
        _, pending = stage_backward_input(out, grads, list(x), stage.parameters())
        peak = _total(tracker, "peak") - after_forward
        for t in x:
            t.grad = None  # sent on (and freed) by the stage
        after_input = _total(tracker, "current")
        stage_backward_weight(stage.parameters(), pending)
    for p in stage.parameters():
        p.grad = None
    return peak, after_input - after_forward


def tracked_peaks(
    stack: Stack,
    layers_per_stage: Sequence[int],
    schedule: str,
    n_microbatches: int,
    stages_per_rank: int = 1,
    recompute: bool = False,
    sharded: Sharded | None = None,
) -> list[int]:
    """The peak bytes ``MemTracker`` sees on every pipeline rank during one training step (see the module docstring).

    Args:
        stack: the model.
        layers_per_stage: the split.
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES`.
        n_microbatches: micro-batches per step.
        stages_per_rank: stages per rank (2 for the V schedules).
        recompute: every layer under activation checkpointing.
        sharded: FSDP2 in every stage (one replica of each stage is tracked; whole backwards only).
    """
    n_ranks = len(layers_per_stage) // stages_per_rank
    orders = rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank)
    ranks = stage_ranks(schedule, n_ranks, stages_per_rank)
    starts = [sum(layers_per_stage[:s]) for s in range(len(layers_per_stage) + 1)]
    peaks = []
    for r in range(n_ranks):
        local = {s: range(starts[s], starts[s + 1]) for s, q in enumerate(ranks) if q == r}
        peaks.append(_rank_peak(stack, orders[r], local, len(layers_per_stage), n_microbatches, recompute, sharded))
    return peaks


def _rank_peak(
    stack: Stack,
    order: list[tuple[str, int, int]],
    stages: dict[int, range],
    n_stages: int,
    m: int,
    recompute: bool,
    sharded: Sharded | None,
) -> int:
    with _replicas(sharded, stack.autocast) as sharding, _fake(stack):
        modules = {s: _stage(stack, layers, recompute, sharding=sharding) for s, layers in stages.items()}
        optimizer = _stepped_adamw(modules)
        shapes = _boundaries(stack, stages, n_stages, sharding)
        recv, grads = _receive_buffers(shapes, stages, n_stages, m)
        first = stack.microbatch()
        tracker = _tracker()
        tracker.track_external(*modules.values(), optimizer, *(t for b in (*recv.values(), *grads.values())
                                                                  for mb in b for t in mb))  # fmt: skip
        with tracker:
            _run(order, modules, recv, grads, first, stack, n_stages, sharding)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _total(tracker, "peak")


def _stepped_adamw(modules: dict[int, StageModule]) -> torch.optim.AdamW:
    """AdamW over the local stages' parameters, one step taken: its state exists, as in every step but the first."""
    params = [p for module in modules.values() for p in module.parameters()]
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _receive_buffers(
    shapes: dict[int, tuple[tuple[Tensor, ...], ...]], stages: dict[int, range], n_stages: int, m: int
) -> tuple[dict[int, list[tuple[Tensor, ...]]], dict[int, list[tuple[Tensor, ...]]]]:
    """PipelineStage's receive buffers of the local stages: inputs and output gradients, one per micro-batch each.

    Args:
        shapes: every local stage's input and output (:func:`_boundaries`).
        stages: the local stages' layers.
        n_stages: stages of the pipeline.
        m: micro-batches per step.

    Returns:
        The input buffers (not on the first stage) and the output-gradient buffers (not on the last), by stage.
    """
    recv = {s: [tuple(torch.empty_like(t) for t in shapes[s][0]) for _ in range(m)] for s in stages if s > 0}
    grads = {s: [tuple(torch.empty_like(t) for t in shapes[s][1]) for _ in range(m)] for s in stages
             if s < n_stages - 1}  # fmt: skip
    return recv, grads


def _boundaries(
    stack: Stack, stages: dict[int, range], n_stages: int, sharding: StageSharding | None = None
) -> dict[int, tuple[tuple[Tensor, ...], ...]]:
    """Every local stage's input and output (fake tensors of one micro-batch), of the layers as the stages hold them.

    Units compute in FSDP2's dtype: their outputs, and the buffers made for them, are in it.
    """
    x, _ = stack.microbatch()
    out: dict[int, tuple[tuple[Tensor, ...], ...]] = {}
    ends = {layers.stop: s for s, layers in stages.items()}
    starts = {layers.start: s for s, layers in stages.items()}
    with torch.no_grad():
        for i in range(max(layers.stop for layers in stages.values())):
            layer = stack.layer(i)
            if sharding is not None:
                sharding.shard_layers([layer])
            if i in starts:
                inputs = as_tuple(x)
            x = layer(*as_tuple(x))
            if i + 1 in ends:
                out[ends[i + 1]] = (inputs, as_tuple(x))
    return out


def _run(
    order: list[tuple[str, int, int]],
    modules: dict[int, StageModule],
    recv: dict[int, list[tuple[Tensor, ...]]],
    grads: dict[int, list[tuple[Tensor, ...]]],
    first: tuple[tuple[Tensor, ...], Tensor],
    stack: Stack,
    n_stages: int,
    sharding: StageSharding | None = None,
) -> None:
    """The rank's tasks in order, as torch's pipeline stage runs them (see ``pipeline/runtime.py``'s ``_Stage``).

    The loop's locals (the last forward's output, the last backward's inputs and their gradients) stay referenced
    until a later task rebinds them, and the tracked peak counts what they hold: so the helpers only compute values,
    and the names that hold them stay in this loop. With ``sharding`` (FSDP2 units, whole backwards), every
    backward runs as the stage runs it and a stage's last one is followed by the reduction (:func:`_reduce`).
    """
    cache: dict[tuple[int, int], Any] = {}
    weights: dict[tuple[int, int], Any] = {}
    last = {s: n for n, (kind, s, _) in enumerate(order) if kind != "F"}  # every stage's last backward task
    inputs0, target = first
    for n, (kind, s, mb) in enumerate(order):
        module = modules[s]
        if kind == "F":
            x = _stage_inputs(recv, s, mb, inputs0)
            y = module(*x)
            out = _stage_ends(stack, y, target, s == n_stages - 1)
            cache[(s, mb)] = (out, list(x), y)  # the output too, as torch's stage keeps it (``fwd_cache``)
            continue
        out, x, _ = cache[(s, mb)] if kind != "W" else (None, None, None)
        g = None if s == n_stages - 1 else list(grads[s][mb])
        with_grad = _needing_grad(x)
        if kind == "B" or (kind == "I" and not with_grad):  # no input gradient: the whole backward at once
            _before_backward(module, sharding)
            stage_backward(out[0] if g is None else out, g, x)  # the loss alone on the last stage, as torch's
            del cache[(s, mb)]
            if sharding is not None and n == last[s]:
                _reduce(module)
        elif kind == "I":
            _, weights[(s, mb)] = stage_backward_input(out, g, x, module.parameters())
            del cache[(s, mb)]
        elif (s, mb) in weights:
            stage_backward_weight(module.parameters(), weights.pop((s, mb)))


def _before_backward(module: nn.Module, sharding: StageSharding | None) -> None:
    """Set FSDP2 up for a micro-batch's backward as the stage does (``PipelineStage.backward_maybe_with_nosync``).

    ``"fast"``: gradient sync off, whole gradients accumulated, weights kept; ``"lean"`` (the runtime's ``_Stage``):
    every unit reduce-scatters its gradient and frees its weights as its backward ends.
    """
    if sharding is None or not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(sharding.lean)
    module.set_requires_gradient_sync(sharding.lean)


def _reduce(module: nn.Module) -> None:
    """The reduction after a stage's last backward, as torch's ``PipelineStage.perform_reduce_grad`` runs it."""
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for group in fsdp_param_groups(unit):
            group.post_backward()
    state._root_post_backward_final_callback()


def _stage_inputs(
    recv: dict[int, list[tuple[Tensor, ...]]], s: int, mb: int, inputs0: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """A forward's inputs: the micro-batch on the first stage, else leaves over the received buffer."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in recv[s][mb]) if s > 0 else inputs0


def _stage_ends(stack: Stack, y: Any, target: Tensor, last: bool) -> list[Tensor]:
    """What a forward's backward starts from: the loss on the last stage, else the stage's outputs."""
    return [stack.loss(y, target)] if last else list(as_tuple(y))


def _needing_grad(x: list[Any] | None) -> list[Tensor]:
    """The inputs of a backward that want a gradient (none: the input and weight parts cannot be split)."""
    return [t for t in (x or []) if isinstance(t, Tensor) and t.requires_grad]


def _language_model(
    n_layers: int, layer: Callable[[int], nn.Module], microbatch: int, seq: int, autocast: bool
) -> Stack:
    """A causal LM's :class:`Stack`: token ids in (their own targets), cross-entropy over the vocabulary out."""

    def batch() -> tuple[tuple[Tensor, ...], Tensor]:
        ids = torch.zeros(microbatch, seq, dtype=torch.long)
        return (ids,), ids

    def loss(logits: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    return Stack(n_layers, layer, batch, loss, autocast)


def gpt_stack(
    n_layer: int, n_embd: int, n_head: int, seq: int, vocab: int, microbatch: int = 1, autocast: bool = False
) -> Stack:
    """The reference GPT (untied) as a :class:`Stack`: embedding, ``n_layer`` blocks, head."""
    from dynmo_lightning.models.blocks import Block, Embedding, Head

    def layer(i: int) -> nn.Module:
        if i == 0:
            return Embedding(vocab, seq, n_embd, 0.0)
        if i == n_layer + 1:
            return Head(n_embd, vocab, True)
        return Block(n_embd, n_head, 4 * n_embd, 0.0, True)

    return _language_model(n_layer + 2, layer, microbatch, seq, autocast)


def llama_stack(
    n_layer: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seq: int,
    microbatch: int = 1,
    autocast: bool = True,
) -> Stack:
    """A Hugging Face Llama as :func:`~dynmo_lightning.models.hf.from_hf` splits it: embedding, decoder layers, head.

    Each layer comes from a one-layer ``LlamaForCausalLM`` of the same shapes (a decoder layer does not depend on
    its index), so building one layer never builds the whole model.
    """
    from dynmo_lightning.models.hf import layers as hf_layers
    from dynmo_lightning.models.hf.model import _family, transformers

    tf = transformers()
    config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=vocab,
                            max_position_embeddings=seq, tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    family = _family(config)

    def layer(i: int) -> nn.Module:
        model = tf.LlamaForCausalLM(config)
        if i == 0:
            return hf_layers.Embedding(model.model.embed_tokens)
        if i == n_layer + 1:
            return hf_layers.Head(model.model.norm, model.lm_head)
        return hf_layers.DecoderLayer(model.model.layers[0], family, model.model.rotary_emb, "sdpa")

    return _language_model(n_layer + 2, layer, microbatch, seq, autocast)


#: The models of the committed table (bf16-mixed, AdamW, micro-batches of one sequence).
MODELS: dict[str, Callable[[], Stack]] = {
    "gpt_1b": lambda: gpt_stack(n_layer=22, n_embd=2048, n_head=16, seq=2048, vocab=50304, autocast=True),
    "llama_7b": lambda: llama_stack(32, 4096, 11008, 32, 32, 32000, 4096),
}

#: ``(schedule, stages per rank, activation checkpointing)`` of the committed table (checkpointing does not run
#: under the split backward).
SCHEDULE_CASES = (("1f1b", 1, False), ("1f1b", 1, True), ("gpipe", 1, False), ("gpipe", 1, True), ("zbv", 2, False))

#: FSDP2 in every stage (1F1B), both ``fsdp_memory`` settings, by model: ``(pipeline ranks, replicas)``.
FSDP_CASES: dict[str, tuple[int, int]] = {"gpt_1b": (4, 8), "llama_7b": (8, 8)}

#: What a row's prediction must be within, relative to its measurement (``predicted / measured - 1``), by the kind
#: of row: the model given measured layers (MemTracker on fake tensors) is exact but for a few KiB of the step's
#: own small tensors, never under by more than 1 %; the lean way prices a layer's gathered weights, whole gradient
#: and reduce-scatter buffers on top of its backward's own peak, which do not all coincide (over, by up to a large
#: head's); real processes priced from the balancer's path (the profiler's bytes: no backward workspace, no
#: forward transient, no loss) within 15 %, and evaluation's peak at most the training step's prediction (what a
#: capacity is checked against).
BOUNDS: dict[str, tuple[float, float]] = {
    "emulated": (-0.01, 0.10),
    "emulated fsdp_memory=lean": (-0.01, 0.25),
    "real": (-0.15, 0.15),
    "real evaluation": (0.0, math.inf),
}


def bound(row: dict[str, Any]) -> tuple[float, float]:
    """The interval :data:`BOUNDS` gives ``row``'s relative error."""
    emulated = row["truth"] == EMULATED
    if emulated:
        return BOUNDS["emulated fsdp_memory=lean" if row["kind"] == "fsdp_memory=lean" else "emulated"]
    return BOUNDS["real evaluation" if row["kind"] == "evaluation" else "real"]


def within(row: dict[str, Any]) -> bool:
    """Whether ``row``'s prediction is within its :func:`bound`."""
    low, high = bound(row)
    return low <= row["relative_error"] <= high


#: The ``truth`` of the rows measured here (the real runs' is :mod:`~dynmo_lightning.bench.memory_runs`').
EMULATED = "MemTracker on fake tensors"


def uniform(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage of the uniform split (as ``partition="uniform"``: the first stages take the remainder)."""
    return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]


def compare(
    stack: Stack,
    ranks: int,
    schedule: str,
    stages_per_rank: int,
    recompute: bool,
    n_microbatches: int,
    sharded: Sharded | None = None,
) -> list[dict[str, Any]]:
    """Per rank: the model's predicted peak, the tracked peak and the old per-layer sum, for the uniform split."""
    split = uniform(stack.n_layers, ranks * stages_per_rank)
    layers = layer_bytes(stack, recompute, sharded)
    model = MemoryModel(layers, schedule, ranks, n_microbatches, stages_per_rank)
    predicted = model.peaks(split)
    tracked = tracked_peaks(stack, split, schedule, n_microbatches, stages_per_rank, recompute, sharded)
    summed = additive(layers, max(model.inflight()))
    starts = [sum(split[:s]) for s in range(len(split) + 1)]
    old = [sum(summed[starts[s] : starts[s + 1]]) for s in range(len(split))]
    per_rank = [sum(old[s] for s, r in enumerate(model.ranks) if r == rank) for rank in range(ranks)]
    rows = []
    for r, (p, t, o) in enumerate(zip(predicted, tracked, per_rank, strict=True)):
        rows.append({"stage": r, "predicted_bytes": int(p), "measured_bytes": int(t), "per_layer_sum_bytes": int(o),
                     "relative_error": p / t - 1})  # fmt: skip
    return rows


def table(models: Sequence[str] = tuple(MODELS), ranks: Sequence[int] = (4, 8)) -> list[dict[str, Any]]:
    """Rows ``{case, kind, stage, predicted_bytes, measured_bytes, ...}`` of every model, size, schedule and FSDP case.

    Cases: every pipeline size of ``ranks`` under every schedule of :data:`SCHEDULE_CASES`, and :data:`FSDP_CASES`.
    """
    rows = []
    for name in models:
        stack = MODELS[name]()
        cases = [(p, schedule, spr, recompute, None) for p in ranks for schedule, spr, recompute in SCHEDULE_CASES]
        if name in FSDP_CASES:
            p, d = FSDP_CASES[name]
            cases += [(p, "1f1b", 1, False, Sharded(d, lean)) for lean in (False, True)]
        for p, schedule, spr, recompute, sharded in cases:
            m = 2 * p
            kind = "schedule" if sharded is None else "fsdp_memory=lean" if sharded.lean else "fsdp"
            case = f"{name} P={p} {schedule}{' AC' if recompute else ''} M={m}"
            case += "" if sharded is None else f" D={sharded.replicas} {kind}"
            for row in compare(stack, p, schedule, spr, recompute, m, sharded):
                rows.append({"case": case, "model": name, "kind": kind, "ranks": p, "schedule": schedule,
                             "activation_checkpointing": recompute, "n_microbatches": m,
                             "replicas": 1 if sharded is None else sharded.replicas, "truth": EMULATED,
                             **row})  # fmt: skip
            errors = [f"{r['relative_error']:+.1%}" for r in rows if r["case"] == case]
            print(f"{case}: {' '.join(errors)}", flush=True)
    return rows


def real_table(work_dir: Path) -> list[dict[str, Any]]:
    """The real processes' rows (:func:`~dynmo_lightning.bench.memory_runs.real_rows`), the plain ones emulated too.

    A plain pipeline row (``kind="pipeline"``) also holds ``emulated_bytes`` (MemTracker's peak of the same step on
    fake tensors: fp32, the same shapes, split and schedule) and ``predicted_from_measured_layers_bytes`` (the model
    given every layer measured alone, its backward's workspace included): they tell what the balancer's path lacks
    from what a real process holds beyond its tensors.
    """
    from dynmo_lightning.bench import memory_runs as runs

    rows = runs.real_rows(work_dir)
    plain = [r for r in rows if r["kind"] == "pipeline"]
    if plain:
        gpt, split = runs.GPT, plain[0]["layers_per_stage"]
        stack = gpt_stack(gpt["n_layer"], gpt["n_embd"], gpt["n_head"], gpt["block_size"], gpt["vocab_size"],
                          microbatch=runs.BATCH // runs.MICROBATCHES)  # fmt: skip
        predicted = MemoryModel(layer_bytes(stack), "1f1b", len(split), runs.MICROBATCHES).peaks(split)
        tracked = tracked_peaks(stack, split, "1f1b", runs.MICROBATCHES)
        for row in plain:
            row["predicted_from_measured_layers_bytes"] = int(predicted[row["stage"]])
            row["emulated_bytes"] = tracked[row["stage"]]
    return rows


def main() -> None:
    """``python -m dynmo_lightning.bench.memory --out docs/bench/memory_model.json`` (about 40 minutes on 2 cores).

    The rows measured on fake tensors (:func:`table`), then those of real processes
    (:func:`real_table`: 4 processes, about 3 minutes; ``--no-real`` skips them).
    """
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default="docs/bench/memory_model.json")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--no-real", action="store_true", help="only the rows measured on fake tensors")
    args = parser.parse_args()
    rows = table(args.models.split(","), [int(r) for r in args.ranks.split(",")])
    if not args.no_real:
        with tempfile.TemporaryDirectory() as work:
            rows += real_table(Path(work))
    outside = [r for r in rows if not within(r)]
    worst = max(abs(r["relative_error"]) for r in rows if r["truth"] == EMULATED)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "bounds": {k: list(v) for k, v in BOUNDS.items()}, "outside_bounds": len(outside),
                   "max_abs_relative_error_emulated": worst, "torch": torch.__version__}, f, indent=1)  # fmt: skip
    print(f"{len(rows)} rows, {len(outside)} outside their bounds, emulated |predicted / measured - 1| <= {worst:.3f}")


if __name__ == "__main__":
    main()
