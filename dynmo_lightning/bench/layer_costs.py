"""What one layer of an LLM-sized model costs on this machine, in every state the dynamics put it in.

Training a 1B-parameter model is out of reach on a 2-core CPU, but one of its layers is not. This module builds single
layers from the model's own modules (:mod:`dynmo_lightning.models.blocks` and the dynamic parts) at LLM sizes
(hidden >= 1024, sequence >= 1024, one micro-batch) and times their forward (``torch.utils.benchmark``) and their
backward (on its own, the graph built untimed before each call) in each state of a dynamic, along one axis at a time:

* ``block`` - a dense block: trainable (forward, backward) and frozen (forward under ``no_grad``, no backward);
* ``attention`` / ``mlp`` - the two halves of a block (with their layer norm) with a kept fraction of heads / hidden
  neurons (structured pruning physically shrinks the matrices): a pruned block costs the sum of its halves;
* ``exit`` - a block whose inputs carry a fraction of active tokens (token early exit: queries and the MLP run on the
  active tokens only, keys and values on all);
* ``mod`` - a Mixture-of-Depths block at a capacity (the routed top-k tokens run the block);
* ``sparse`` - a block whose attention is block-sparse at a density (the rest dense);
* ``expert`` - one MoE expert (an MLP) on a number of tokens, and ``moe_rest`` - a block's attention half plus the
  router: an MoE block costs ``moe_rest`` plus its experts' costs on their token counts;
* ``embedding`` and ``head`` - the first and last pipeline layers (the head with the vocabulary projection and the
  loss).

:func:`measure` returns a JSON-ready table; :class:`CostTable` interpolates it linearly along each axis. Activation
bytes (what autograd saves for backward) are recorded next to every trainable time, and so is ``wgt``, the
weight-gradient part of the backward (zero-bubble schedules run it as a task of its own): the backward less the
time of the input gradient alone (``torch.autograd.grad`` with respect to the layer's input only, which skips the
weight-gradient matmuls), both timed on their own graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import benchmark

from dynmo_lightning.models.blocks import MLP, Block, CausalSelfAttention, Embedding, Head
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention
from dynmo_lightning.profiling import DeviceClock

#: Fractions measured along every axis (kept heads and neurons, active tokens, capacity, density).
FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 0.75, 1.0)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The size of the measured layers (and of the model the realistic traces describe).

    Attributes:
        hidden: hidden size.
        heads: attention heads.
        seq: tokens per sequence.
        micro_batch: sequences per micro-batch.
        vocab: vocabulary of the embedding and the head.
        mlp_ratio: MLP hidden size over ``hidden``.
        n_experts: experts of an MoE block.
        attn_block: block size of sparse attention.
    """

    hidden: int = 1024
    heads: int = 16
    seq: int = 1024
    micro_batch: int = 1
    vocab: int = 32000
    mlp_ratio: int = 4
    n_experts: int = 8
    attn_block: int = 64

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.seq * self.micro_batch

    def block_params(self, mlp_kept: float = 1.0, heads_kept: float = 1.0) -> int:
        """Parameters of a block (biases and norms included) with kept fractions of neurons and heads."""
        h, mlp = self.hidden, round(self.mlp_ratio * self.hidden * mlp_kept)
        attn = round(self.heads * heads_kept) * (h // self.heads)
        return 4 * h + (3 * attn * h + 3 * attn) + (attn * h + h) + (h * mlp + mlp) + (mlp * h + h)

    def moe_params(self) -> int:
        """Parameters of an MoE block (every expert a full MLP, plus the router)."""
        h, mlp = self.hidden, self.mlp_ratio * self.hidden
        return self.block_params(mlp_kept=0.0) + self.n_experts * (2 * h * mlp + mlp + h) + h * self.n_experts


class LayerCost(NamedTuple):
    """Seconds of one layer call for one micro-batch.

    Attributes:
        fwd: forward.
        bwd: the whole backward (input and weight gradients).
        wgt: the weight-gradient part of ``bwd`` (0 where the table holds no split).
    """

    fwd: float
    bwd: float
    wgt: float = 0.0

    def plus(self, other: LayerCost) -> LayerCost:
        """The cost of this call and ``other`` one after the other (field by field; ``+`` would concatenate)."""
        return LayerCost(*(a + b for a, b in zip(self, other, strict=True)))


def _timer(fn: Callable[[], Any], min_run_time: float) -> float:
    """Median seconds of one call of ``fn`` (``torch.utils.benchmark``: warmed up, blocked, median of blocks)."""
    fn()
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _backward_timer(graph: Callable[[], Tensor], backward: Callable[[Tensor], Any], min_run_time: float) -> float:
    """Median seconds of ``backward(graph())``, the graph built untimed before every call.

    Timed on its own, a backward is a positive time however busy the machine: the difference of two timed runs
    (forward and backward, less forward) read 0 for a small layer when the second run was the luckier one.
    """
    backward(graph())  # warm-up (allocator, kernels)
    times: list[float] = []
    while sum(times) < min_run_time or len(times) < 5:
        root = graph()
        clock = DeviceClock(root.device)
        start = clock.now()
        backward(root)
        times.append(clock.elapsed(start, clock.now()))
    return float(np.median(times))


@contextlib.contextmanager
def _saved_bytes(total: list[int]) -> Iterator[None]:
    """Count the bytes autograd saves for backward (parameters excluded) into ``total[0]``."""
    seen: set[int] = set()

    def pack(t: Tensor) -> Tensor:
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def time_layer(
    forward: Callable[[], Any],
    params: Sequence[Tensor],
    *,
    trainable: bool = True,
    min_run_time: float = 1.0,
    inputs: Sequence[Tensor] | None = None,
) -> dict[str, float]:
    """Forward and backward seconds (and saved activation bytes) of one layer call.

    Args:
        forward: runs the layer on its (prepared) inputs and returns a tensor or a tuple whose first is the output.
        params: the layer's parameters (their gradients are dropped between calls).
        trainable: time backward too; otherwise the forward runs under ``no_grad``, as a frozen prefix does.
        min_run_time: seconds each ``blocked_autorange`` measures for.
        inputs: the float inputs ``forward`` reads: the input gradient alone is timed too, and ``wgt`` (the rest of
            the backward) recorded; ``()``: the layer has no input gradient (an embedding), its backward is all
            weight gradient; ``None``: no split.
    """
    if not trainable:
        with torch.no_grad():
            return {"fwd": _timer(forward, min_run_time), "bwd": 0.0, "activation_bytes": 0.0, "wgt": 0.0}

    def loss() -> Tensor:
        out = forward()
        return (out[0] if isinstance(out, tuple) else out).float().square().mean()

    def backward(root: Tensor) -> None:
        root.backward()
        for p in params:
            p.grad = None

    saved = [0]
    with _saved_bytes(saved):
        forward()
    fwd = _timer(forward, min_run_time)
    bwd = _backward_timer(loss, backward, min_run_time)
    cost = {"fwd": fwd, "bwd": bwd, "activation_bytes": float(saved[0])}
    if inputs is not None:
        wanted = list(inputs)
        # the input gradient alone: autograd computes only what leads to ``inputs``, no weight-gradient matmul
        data = _backward_timer(loss, lambda root: torch.autograd.grad(root, wanted), min_run_time) if wanted else 0.0
        cost["wgt"] = bwd - min(data, bwd)
    return cost


def graft_weight_parts(table: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``table`` with the weight-gradient share of every cost of ``measured`` applied to its own backward times.

    A committed table measured before the split keeps its forward and backward times (and what was simulated from
    them); a fresh measurement at the same shape supplies ``wgt / bwd`` of every entry.
    """

    def graft(old: Any, new: Any) -> Any:
        if isinstance(old, dict) and "bwd" in old:
            share = new.get("wgt", 0.0) / new["bwd"] if new.get("bwd") else 0.0
            return {**old, "wgt": old["bwd"] * share}
        if isinstance(old, dict):
            # the axes' keys (a fraction, a token count) match by value: JSON made them strings
            by_value = {_key(k): v for k, v in new.items()} if isinstance(new, dict) else {}
            return {k: graft(v, by_value[_key(k)]) if _key(k) in by_value else v for k, v in old.items()}
        return old

    if table["shape"] != measured["shape"]:
        raise ValueError(f"weight parts measured at {measured['shape']}, the table is at {table['shape']}")
    fixed = ("shape", "machine")
    return {k: graft(v, measured[k]) if k in measured and k not in fixed else v for k, v in table.items()}


def _key(k: Any) -> Any:
    try:
        return float(k)
    except (TypeError, ValueError):
        return k


def _hidden(shape: LayerShape, requires_grad: bool = True) -> Tensor:
    return torch.randn(shape.micro_batch, shape.seq, shape.hidden).requires_grad_(requires_grad)


def _norm_then(norm: nn.Module, part: nn.Module) -> Callable[[Tensor], Tensor]:
    return lambda x: x + part(norm(x))


def _block(shape: LayerShape, **parts: Any) -> Block:
    return Block(shape.hidden, shape.heads, shape.mlp_ratio * shape.hidden, 0.0, True, **parts)


def _block_states(shape: LayerShape, seconds: float) -> dict[str, Any]:
    block, x = _block(shape), _hidden(shape)
    params = list(block.parameters())
    trainable = time_layer(lambda: block(x), params, min_run_time=seconds, inputs=[x])
    for p in params:
        p.requires_grad_(False)
    frozen = time_layer(lambda: block(x.detach()), params, trainable=False, min_run_time=seconds)
    return {"block": {"trainable": trainable, "frozen": frozen}}


def _pruned_halves(shape: LayerShape, seconds: float) -> dict[str, Any]:
    """The attention half at kept heads and the MLP half at kept neurons (each with its layer norm)."""
    h, x = shape.hidden, _hidden(shape)
    out: dict[str, Any] = {"attention": {}, "mlp": {}}
    for kept in FRACTIONS:
        heads = max(1, round(shape.heads * kept))
        attn = CausalSelfAttention(h, shape.heads, 0.0, True)
        attn.keep_units(torch.arange(heads))
        neurons = max(1, round(shape.mlp_ratio * h * kept))
        for axis, part, share in (("attention", attn, heads / shape.heads), ("mlp", MLP(h, neurons, 0.0, True), kept)):
            norm = nn.LayerNorm(h)
            half = _norm_then(norm, part)
            params = [*part.parameters(), *norm.parameters()]
            out[axis][share] = time_layer(lambda half=half: half(x), params, min_run_time=seconds, inputs=[x])
    return out


def _exit_states(shape: LayerShape, seconds: float) -> dict[str, Any]:
    """A block on a fraction of active tokens (the same fraction in every sequence, at random positions)."""
    block = _block(shape, early_exit=True)
    out = {}
    for active in FRACTIONS:
        x, aux = _hidden(shape), torch.zeros(shape.micro_batch)
        n = max(1, round(active * shape.seq))
        mask = torch.zeros(shape.micro_batch, shape.seq)
        for b in range(shape.micro_batch):
            mask[b, torch.randperm(shape.seq)[:n]] = 1.0
        call = lambda x=x, mask=mask, aux=aux: block(x, mask, aux)  # noqa: E731
        out[n / shape.seq] = time_layer(call, list(block.parameters()), min_run_time=seconds, inputs=[x])
    return {"exit": out}


def _mod_states(shape: LayerShape, seconds: float) -> dict[str, Any]:
    """A routed block at a capacity (its router picks the top-k tokens of every sequence)."""
    out = {}
    for capacity in FRACTIONS:
        block = _block(shape, mod_capacity=capacity)
        x, active, aux = _hidden(shape), torch.ones(shape.micro_batch, shape.seq), torch.zeros(shape.micro_batch)
        call = lambda block=block, x=x, active=active, aux=aux: block(x, active, aux)  # noqa: E731
        out[capacity] = time_layer(call, list(block.parameters()), min_run_time=seconds, inputs=[x])
    return {"mod": out}


def _sparse_states(shape: LayerShape, seconds: float) -> dict[str, Any]:
    """A block with block-sparse attention, keyed by the share of the causal key blocks it computes."""
    out = {}
    n_blocks = shape.seq // shape.attn_block
    for density in FRACTIONS:
        attn = SparseCausalSelfAttention(
            shape.hidden, shape.heads, 0.0, True, attn_block=shape.attn_block, density=density
        )
        block, x = _block(shape, attn=attn), _hidden(shape)
        kept = sum(attn.blocks_kept(n_blocks)) / (n_blocks * (n_blocks + 1) / 2)
        out[kept] = time_layer(
            lambda block=block, x=x: block(x), list(block.parameters()), min_run_time=seconds, inputs=[x]
        )
    return {"sparse": out}


def _moe_states(shape: LayerShape, seconds: float) -> dict[str, Any]:
    """One expert on a number of tokens, and the rest of an MoE block (attention half and router)."""
    h, experts = shape.hidden, {}
    for share in (*FRACTIONS, 2.0):  # a hot expert may take more than its even share of the tokens
        n = max(1, round(share * shape.tokens / shape.n_experts))
        expert, x = MLP(h, shape.mlp_ratio * h, 0.0, True), torch.randn(n, h, requires_grad=True)
        experts[n] = time_layer(
            lambda expert=expert, x=x: expert(x), list(expert.parameters()), min_run_time=seconds, inputs=[x]
        )
    attn, norm = CausalSelfAttention(h, shape.heads, 0.0, True), nn.LayerNorm(h)
    router, x = nn.Linear(h, shape.n_experts, bias=False), _hidden(shape)

    def rest() -> Tensor:
        y = x + attn(norm(x))
        return y + router(y).softmax(-1).sum(-1, keepdim=True)

    params = [*attn.parameters(), *norm.parameters(), *router.parameters()]
    return {"expert": experts, "moe_rest": time_layer(rest, params, min_run_time=seconds, inputs=[x])}


def _ends(shape: LayerShape, seconds: float) -> dict[str, Any]:
    h = shape.hidden
    embed = Embedding(shape.vocab, shape.seq, h, 0.0)
    idx = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq))
    head = Head(h, shape.vocab, True)
    x, target = _hidden(shape), torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq))

    def head_and_loss() -> Tensor:
        logits = head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return {
        "embedding": time_layer(lambda: embed(idx), list(embed.parameters()), min_run_time=seconds, inputs=()),
        "head": time_layer(head_and_loss, list(head.parameters()), min_run_time=seconds, inputs=[x]),
    }


#: What :func:`measure` times, in order.
PARTS = {
    "dense and frozen block": _block_states,
    "pruned attention and MLP": _pruned_halves,
    "early exit": _exit_states,
    "Mixture of Depths": _mod_states,
    "sparse attention": _sparse_states,
    "Mixture of Experts": _moe_states,
    "embedding and head": _ends,
}


def measure(
    shape: LayerShape = LayerShape(),
    *,
    parts: Sequence[str] = tuple(PARTS),
    threads: int | None = None,
    min_run_time: float = 1.0,
    device: str = "auto",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time every layer kind in every state at ``shape`` on this machine (see the module docstring).

    Args:
        shape: the layers' size.
        parts: which of :data:`PARTS` to measure (all by default).
        threads: torch threads (default: as set); the measurement runs in this one process.
        min_run_time: seconds every ``blocked_autorange`` measures for.
        device: where the layers run: ``"auto"`` (the accelerator if there is one, else the CPU), ``"cpu"``,
            ``"cuda"``...; ``torch.utils.benchmark`` synchronises the accelerator around every timed call.
        log: progress lines.

    Returns:
        ``{"shape", "machine", "threads", "block", "attention", "mlp", "exit", "mod", "sparse", "expert",
        "moe_rest", "embedding", "head"}``: costs ``{"fwd", "bwd", "activation_bytes"}`` (seconds, bytes), keyed
        by the state's value where there is an axis.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    if device == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = accelerator.type if accelerator is not None else "cpu"
    torch.manual_seed(0)
    table: dict[str, Any] = {"shape": dataclasses.asdict(shape), "machine": machine(device)}
    table["threads"] = torch.get_num_threads()
    # Layers and inputs are created on the device: every factory call inside lands there.
    with torch.device(device):
        for name in parts:
            log(f"[layer costs] {name}: hidden {shape.hidden}, sequence {shape.seq}, {device}")
            table.update(PARTS[name](shape, min_run_time))
    return table


def machine(device: str = "cpu") -> dict[str, str]:
    """Where the numbers come from (the accelerator's name when ``device`` is one)."""
    import lightning

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "device": device,
    }
    if device.startswith("cuda"):
        info["device"] = torch.cuda.get_device_name()
    return info


class CostTable:
    """A measured table (:func:`measure`), interpolated: the cost of a layer in any state.

    Args:
        table: the JSON-ready dictionary :func:`measure` returns (keys of the axes may be strings after JSON).
    """

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = table
        self.shape = LayerShape(**table["shape"])

    def _axis(self, name: str, value: float) -> LayerCost:
        """The cost interpolated at ``value`` along axis ``name``."""
        points = sorted((float(k), v) for k, v in self.table[name].items())
        xs = [p for p, _ in points]
        return LayerCost(*(float(np.interp(value, xs, [c.get(f, 0.0) for _, c in points])) for f in LayerCost._fields))

    def block(self, *, frozen: bool = False, mlp_kept: float = 1.0, heads_kept: float = 1.0) -> LayerCost:
        """A dense (possibly pruned) block; a frozen one costs its forward without autograd and no backward."""
        if mlp_kept >= 1.0 and heads_kept >= 1.0:
            return _cost(self.table["block"]["frozen" if frozen else "trainable"])
        attn, mlp = self._axis("attention", heads_kept), self._axis("mlp", mlp_kept)
        if frozen:
            full = self.table["block"]
            return LayerCost((attn.fwd + mlp.fwd) * full["frozen"]["fwd"] / full["trainable"]["fwd"], 0.0)
        return attn.plus(mlp)

    def exit(self, active: float) -> LayerCost:
        """A block whose input has a fraction ``active`` of its tokens still active."""
        return self._axis("exit", active)

    def mod(self, capacity: float) -> LayerCost:
        """A Mixture-of-Depths block routing a fraction ``capacity`` of the tokens."""
        return self._axis("mod", capacity)

    def sparse(self, kept: float) -> LayerCost:
        """A block whose attention computes a fraction ``kept`` of the causal key blocks."""
        return self._axis("sparse", kept)

    def moe(self, expert_tokens: Sequence[float]) -> LayerCost:
        """An MoE block whose experts take ``expert_tokens`` tokens each (of one micro-batch)."""
        total = _cost(self.table["moe_rest"])
        for n in expert_tokens:
            if n >= 1:
                total = total.plus(self._axis("expert", n))
        return total

    def end(self, name: str) -> LayerCost:
        """The embedding (``"embedding"``) or the head with the loss (``"head"``)."""
        return _cost(self.table[name])


def table_file(dynamic: str) -> str:
    """The layer-cost file a dynamic's timelines are priced with: sparse attention's, measured at a longer sequence."""
    return "layer_costs_long.json" if dynamic == "sparse_attention" else "layer_costs.json"


def _cost(entry: dict[str, float]) -> LayerCost:
    return LayerCost(entry["fwd"], entry["bwd"], entry.get("wgt", 0.0))


def block_gflops(table: dict[str, Any]) -> float:
    """Forward GFLOP/s of the dense block: how fast the measured machine is (matmuls and attention only)."""
    s = LayerShape(**table["shape"])
    flops = 2 * s.tokens * (4 + 2 * s.mlp_ratio) * s.hidden**2 + 4 * s.seq * s.tokens * s.hidden
    fwd = table["block"]["trainable"]["fwd"]
    return flops / fwd / 1e9 if fwd else math.nan
