"""Every stage's memory at real sizes without a GPU: the schedule's own task order run on fake tensors, tracked.

The truth the memory model (:mod:`dynmo_lightning.balance.steptime.memory_model`) is checked against. For one pipeline
rank at a time, its stages are built at full size under ``FakeTensorMode`` (fake CPU tensors: nothing is allocated; byte
counts do not depend on the device), with the receive buffers torch's ``PipelineStage`` keeps (one input and one
output-gradient buffer per micro-batch) and AdamW with its state; then one training step runs the rank's tasks in the
order of the schedule (:func:`~dynmo_lightning.balance.steptime.makespan.rank_orders`) with torch's own backward
functions (``stage_backward``, and ``stage_backward_input`` / ``stage_backward_weight`` for the zero-bubble schedules'
split backward), and the optimizer step; torch's ``MemTracker`` reports the peak. Layers run through the project's
:class:`~dynmo_lightning.pipeline.layers.StageModule`, so activation checkpointing is the runtime's.

The same layers measured one at a time (:func:`layer_bytes`, with the project's profiler) give the model its inputs:
parameters, gradients, optimizer state, what a layer keeps for backward per micro-batch and its input's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import rank_orders
from dynmo_lightning.balance.steptime.memory_model import LayerBytes, MemoryModel, additive
from dynmo_lightning.core.layer_calls import as_tuple
from dynmo_lightning.pipeline.layers import StageModule
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


def _stage(stack: Stack, layers: range, recompute: bool, profiler: LayerProfiler | None = None) -> StageModule:
    torch.manual_seed(0)
    modules = [stack.layer(i) for i in layers]
    return StageModule(modules, layers.start, profiler, frozenset(layers) if recompute else frozenset())


def layer_bytes(stack: Stack, recompute: bool = False) -> list[LayerBytes]:
    """Every layer's bytes as the model needs them, measured one layer at a time on fake tensors.

    Parameters, gradients and AdamW state from the tensors' sizes; the bytes a layer keeps for backward per
    micro-batch (and, checkpointed, what its recomputation holds) from the project's profiler, as a profiled step
    reports them to the balancer; its input's bytes from the activation it receives; and, tracked by ``MemTracker``,
    what its backward allocates besides the gradients at its peak (:attr:`LayerBytes.workspace`) and what a
    micro-batch holds more between a split backward's input and weight parts (:attr:`LayerBytes.split_extra`).
    """
    out = []
    with _fake(stack):
        x, target = stack.microbatch()
        for i in range(stack.n_layers):
            layer, y = _one_layer_bytes(stack, i, x, target, recompute)
            out.append(layer)
            x = tuple(t.detach() for t in as_tuple(y))
    return out


def _one_layer_bytes(stack: Stack, i: int, x: Any, target: Tensor, recompute: bool) -> tuple[LayerBytes, Any]:
    """Layer ``i``'s bytes (see :func:`layer_bytes`) from its input ``x``; with the output its profiled step made.

    Args:
        stack: the model.
        i: the layer.
        x: the layer's input (the previous layer's output, detached; the micro-batch's input for the first).
        target: the micro-batch's target (the last layer's loss takes it).
        recompute: the layer under activation checkpointing.

    Returns:
        The layer's :class:`LayerBytes` and its output (the next layer's input).
    """
    profiler = LayerProfiler(torch.device("cpu"))
    stage = _stage(stack, range(i, i + 1), recompute, profiler)
    x = tuple(t.detach().requires_grad_(t.is_floating_point() and i > 0) for t in as_tuple(x))
    params = static_memory(stage, None)[0]
    grads = sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)
    y, cost = _profiled_step(stack, stage, profiler, i, x, target)
    last = i == stack.n_layers - 1
    loss_target = target if last else None  # the loss only on the last layer
    first, again = _backward_peaks(stage, x, loss_target, stack)
    # (activation checkpointing does not run under the split backward: strategy.activation_checkpointing)
    split = i > 0 and not recompute
    split_extra = _split_extra(stage, x, loss_target, stack) if split else 0.0
    activations = cost.activation_bytes + (_loss_held(y, target, stack) if last else 0)
    inputs = sum(t.numel() * t.element_size() for t in x if t.is_floating_point())
    # every weight copy here is autocast's cast (no FSDP2): its gradient is the copy's size (LayerBytes.cast_grads)
    layer = LayerBytes(params, grads, 2 * grads, activations, cost.recompute_bytes, inputs, first - grads, split_extra,
                       cost.weight_copies_bytes, cast_grads=cost.weight_copies_bytes, workspace_again=again, outputs=_size(y))  # fmt: skip
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


def _backward_peaks(stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack) -> tuple[int, int]:
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
            stage_backward(out[0] if grads is None else out, grads, list(x))
            peaks.append(_total(tracker, "peak") - before)
        del out, grads
    for p in stage.parameters():
        p.grad = None
    return peaks[0], peaks[1]


def _split_extra(stage: nn.Module, x: tuple[Tensor, ...], target: Tensor | None, stack: Stack) -> int:
    """What a micro-batch holds more after a split backward's input part than after its forward."""
    tracker = _tracker()
    tracker.track_external(stage, *x)
    with tracker:
        out, grads = _outputs(stage, x, target, stack)
        after_forward = _total(tracker, "current")
        _, pending = stage_backward_input(out, grads, list(x), stage.parameters())
        for t in x:
            t.grad = None  # sent on (and freed) by the stage
        after_input = _total(tracker, "current")
        stage_backward_weight(stage.parameters(), pending)
    for p in stage.parameters():
        p.grad = None
    return after_input - after_forward


def tracked_peaks(
    stack: Stack,
    layers_per_stage: Sequence[int],
    schedule: str,
    n_microbatches: int,
    stages_per_rank: int = 1,
    recompute: bool = False,
) -> list[int]:
    """The peak bytes ``MemTracker`` sees on every pipeline rank during one training step (see the module docstring).

    Args:
        stack: the model.
        layers_per_stage: the split.
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES`.
        n_microbatches: micro-batches per step.
        stages_per_rank: stages per rank (2 for the V schedules).
        recompute: every layer under activation checkpointing.
    """
    n_ranks = len(layers_per_stage) // stages_per_rank
    orders = rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank)
    ranks = stage_ranks(schedule, n_ranks, stages_per_rank)
    starts = [sum(layers_per_stage[:s]) for s in range(len(layers_per_stage) + 1)]
    peaks = []
    for r in range(n_ranks):
        local = {s: range(starts[s], starts[s + 1]) for s, q in enumerate(ranks) if q == r}
        peaks.append(_rank_peak(stack, orders[r], local, len(layers_per_stage), n_microbatches, recompute))
    return peaks


def _rank_peak(
    stack: Stack, order: list[tuple[str, int, int]], stages: dict[int, range], n_stages: int, m: int, recompute: bool
) -> int:
    with _fake(stack):
        modules = {s: _stage(stack, layers, recompute) for s, layers in stages.items()}
        optimizer = _stepped_adamw(modules)
        shapes = _boundaries(stack, stages, n_stages)
        recv, grads = _receive_buffers(shapes, stages, n_stages, m)
        first = stack.microbatch()
        tracker = _tracker()
        tracker.track_external(*modules.values(), optimizer, *(t for b in (*recv.values(), *grads.values())
                                                                  for mb in b for t in mb))  # fmt: skip
        with tracker:
            _run(order, modules, recv, grads, first, stack, n_stages)
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


def _boundaries(stack: Stack, stages: dict[int, range], n_stages: int) -> dict[int, tuple[tuple[Tensor, ...], ...]]:
    """Every local stage's input and output (meta-like fake tensors of one micro-batch)."""
    x, _ = stack.microbatch()
    out: dict[int, tuple[tuple[Tensor, ...], ...]] = {}
    ends = {layers.stop: s for s, layers in stages.items()}
    starts = {layers.start: s for s, layers in stages.items()}
    with torch.no_grad():
        for i in range(max(layers.stop for layers in stages.values())):
            layer = stack.layer(i)
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
) -> None:
    """The rank's tasks in order, as torch's pipeline stage runs them (see ``pipeline/runtime.py``'s ``_Stage``).

    The loop's locals (the last forward's output, the last backward's inputs and their gradients) stay referenced
    until a later task rebinds them, and the tracked peak counts what they hold: so the helpers only compute values,
    and the names that hold them stay in this loop.
    """
    cache: dict[tuple[int, int], Any] = {}
    weights: dict[tuple[int, int], Any] = {}
    inputs0, target = first
    for kind, s, mb in order:
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
            stage_backward(out[0] if g is None else out, g, x)  # the loss alone on the last stage, as torch's
            del cache[(s, mb)]
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


def uniform(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage of the uniform split (as ``partition="uniform"``: the first stages take the remainder)."""
    return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]


def compare(
    stack: Stack, ranks: int, schedule: str, stages_per_rank: int, recompute: bool, n_microbatches: int
) -> list[dict[str, Any]]:
    """Per rank: the model's predicted peak, the tracked peak and the old per-layer sum, for the uniform split."""
    split = uniform(stack.n_layers, ranks * stages_per_rank)
    layers = layer_bytes(stack, recompute)
    model = MemoryModel(layers, schedule, ranks, n_microbatches, stages_per_rank)
    predicted = model.peaks(split)
    tracked = tracked_peaks(stack, split, schedule, n_microbatches, stages_per_rank, recompute)
    summed = additive(layers, max(model.inflight()))
    starts = [sum(split[:s]) for s in range(len(split) + 1)]
    old = [sum(summed[starts[s] : starts[s + 1]]) for s in range(len(split))]
    per_rank = [sum(old[s] for s, r in enumerate(model.ranks) if r == rank) for rank in range(ranks)]
    rows = []
    for r, (p, t, o) in enumerate(zip(predicted, tracked, per_rank, strict=True)):
        rows.append({"stage": r, "predicted_bytes": int(p), "tracked_bytes": int(t), "per_layer_sum_bytes": int(o),
                     "relative_error": p / t - 1})  # fmt: skip
    return rows


def table(models: Sequence[str] = tuple(MODELS), ranks: Sequence[int] = (4, 8)) -> list[dict[str, Any]]:
    """Rows ``{case, stage, predicted_bytes, tracked_bytes, ...}`` of every model, pipeline size and schedule."""
    rows = []
    for name in models:
        stack = MODELS[name]()
        for p in ranks:
            for schedule, spr, recompute in SCHEDULE_CASES:
                m = 2 * p
                case = f"{name} P={p} {schedule}{' AC' if recompute else ''} M={m}"
                for row in compare(stack, p, schedule, spr, recompute, m):
                    rows.append({"case": case, "model": name, "ranks": p, "schedule": schedule,
                                 "activation_checkpointing": recompute, "n_microbatches": m, **row})  # fmt: skip
                errors = [f"{r['relative_error']:+.1%}" for r in rows if r["case"] == case]
                print(f"{case}: {' '.join(errors)}", flush=True)
    return rows


def main() -> None:
    """``python -m dynmo_lightning.bench.memory --out docs/bench/memory_model.json`` (about 15 minutes here)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default="docs/bench/memory_model.json")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default="4,8")
    args = parser.parse_args()
    rows = table(args.models.split(","), [int(r) for r in args.ranks.split(",")])
    worst = max(abs(r["relative_error"]) for r in rows)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "max_abs_relative_error": worst, "torch": torch.__version__}, f, indent=1)
    print(f"{len(rows)} rows, largest |predicted / tracked - 1| = {worst:.3f}")


if __name__ == "__main__":
    main()
