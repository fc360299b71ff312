"""One training step of every pipeline rank in its schedule's own task order on fake tensors, its peak tracked.

Each rank's stages are built at full size with the receive buffers torch's ``PipelineStage`` keeps (one input and one
output-gradient buffer per micro-batch) and AdamW with its state; the rank's tasks run with torch's own backward
functions, the stage keeping every micro-batch's output until its backward, then the optimizer step; ``MemTracker``
reports the peak (:mod:`~dynmo_lightning.bench.memory` tells the whole method).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import rank_orders
from dynmo_lightning.bench import memory_emulator as emulator
from dynmo_lightning.bench.memory_stacks import Stack
from dynmo_lightning.core.layer_calls import as_tuple
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.stage.slots import StageModule


def tracked_peaks(
    stack: Stack,
    layers_per_stage: Sequence[int],
    schedule: str,
    n_microbatches: int,
    stages_per_rank: int = 1,
    recompute: bool = False,
    sharded: emulator.Sharded | None = None,
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
    sharded: emulator.Sharded | None,
) -> int:
    with emulator.fake_replicas(sharded, stack.autocast) as sharding, emulator.fake_tensors(stack):
        modules = {s: emulator.build_stage(stack, layers, recompute, sharding=sharding) for s, layers in stages.items()}
        optimizer = _stepped_adamw(modules)
        shapes = _boundaries(stack, stages, n_stages, sharding)
        recv, grads = _receive_buffers(shapes, stages, n_stages, m)
        first = stack.microbatch()
        tracker = emulator.hookless_tracker()
        tracker.track_external(*modules.values(), optimizer, *(t for b in (*recv.values(), *grads.values())
                                                                  for mb in b for t in mb))  # fmt: skip
        with tracker:
            _run(order, modules, recv, grads, first, stack, n_stages, sharding)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return emulator.tracked_bytes(tracker, "peak")


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
    """The rank's tasks in order, as torch's pipeline stage runs them (see ``pipeline/stage/runtime.py``'s ``_Stage``).

    The loop's locals (the last forward's output, the last backward's inputs and their gradients) stay referenced
    until a later task rebinds them, and the tracked peak counts what they hold: so the helpers only compute values,
    and the names that hold them stay in this loop. With ``sharding`` (FSDP2 units, whole backwards), every
    backward runs as the stage runs it and a stage's last one is followed by the reduction
    (:func:`~dynmo_lightning.bench.memory_emulator.reduce_gradients`).
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
            emulator.before_backward(module, sharding)
            stage_backward(out[0] if g is None else out, g, x)  # the loss alone on the last stage, as torch's
            del cache[(s, mb)]
            if sharding is not None and n == last[s]:
                emulator.reduce_gradients(module)
        elif kind == "I":
            _, weights[(s, mb)] = stage_backward_input(out, g, x, module.parameters())
            del cache[(s, mb)]
        elif (s, mb) in weights:
            stage_backward_weight(module.parameters(), weights.pop((s, mb)))


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
