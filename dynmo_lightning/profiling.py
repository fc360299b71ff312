"""Per-layer cost measured inside the real training step: forward and backward time, and memory.

When a step is profiled, each stage runs its layers through :meth:`LayerProfiler.run` instead of plainly:

* forward time: a clock reading before and after every layer (``time.perf_counter`` on CPU, CUDA events on GPU);
* backward time: a gradient hook on the activations at every layer boundary fires when the gradient reaches that
  boundary, so a layer's backward time is the gap between the boundary after it and the one before it. When a
  layer's input carries no gradient (token ids into the embedding, the output of a frozen prefix), its backward ends
  with its last parameter-gradient accumulation instead. Hooks observe; they never change a value, so profiling
  leaves the math untouched;
* zero-bubble schedules split a backward into an input pass (``stage_backward_input``: gradients of the activations,
  where the boundary hooks fire, so the gaps above time each layer's input part) and a later weight pass
  (``stage_backward_weight``: gradients of the parameters, set as ``.grad`` without an accumulation). The runtime's
  stage opens :meth:`LayerProfiler.weight_pass` around it; a gradient hook on every parameter stamps the moment
  that parameter's gradient is done, and the gap since the previous stamp counts for its layer (the boundary
  hooks, which the weight pass fires again on its way through the activations, are ignored there). A layer's
  ``bwd_input`` and ``bwd_weight`` are the two parts, ``bwd`` their sum: what runs in the schedule's input slot
  and in its weight slot. torch runs the first stage's whole backward in the weight slot (nothing to send
  upstream), and a stage whose inputs carry no gradient runs it whole in the input slot (see the runtime's
  ``_Stage``); under a schedule that does not split, the whole backward is ``bwd_input``;
* activation memory: bytes of the tensors autograd saves for backward inside each layer (``saved_tensors_hooks``),
  parameters excluded, per micro-batch.

A layer under activation checkpointing (:mod:`~dynmo_lightning.recompute`) saves only its inputs, which are then its
activation bytes; what its recomputation rebuilds in backward, one layer at a time, is counted apart
(``recompute_bytes``). Its recomputation runs after the gradient reached the boundary after it and before it reaches
the one before it, so the layer's backward time includes it.

Values are per micro-batch (averaged over the step's micro-batches). Unprofiled steps run the layers untouched, so
the overhead is paid only on sampled steps. :class:`~dynmo_lightning.balance.CostTracker` smooths the gathered
measurements of all layers (median of the recent ones, then an exponential moving average); the balancer plans with
it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from dynmo_lightning.core.layer_calls import as_tuple, call_layer
from dynmo_lightning.core.parts import local_part
from dynmo_lightning.recompute import checkpointed_call


class DeviceClock:
    """Timestamps that mean device time: CUDA events on GPU, ``perf_counter`` elsewhere.

    On a GPU the host only enqueues work: a host clock around it would time the enqueue. Events recorded on the
    current stream time the work itself, and nothing waits for the device until a duration is read.

    Args:
        device: the device whose work is timed.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        """A timestamp: a recorded CUDA event on GPU, a ``perf_counter`` reading elsewhere."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (on GPU this waits until the device has reached ``end``)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


#: Side of the calibration kernel's square matrices: small on CPU (a few milliseconds), large enough on a GPU that
#: its time is compute, not launch latency.
CALIBRATION_SIZE = {"cpu": 128, "cuda": 4096}


def calibration_seconds(device: torch.device, repeats: int = 3) -> float:
    """Seconds a fixed kernel takes on ``device`` now: the process's speed, measured (the best of ``repeats``).

    A few square matrix products whose cost never changes (unlike any layer's under a dynamic), so that the ratio of
    two processes' times is the ratio of their speeds (``balance/decision/speeds.py`` says why a kernel). The
    matrices are made once per device and kept; on a GPU the timing waits for the device once per repeat.
    """
    a = _calibration_input(device.type, device.index)
    clock, best = DeviceClock(device), float("inf")
    for _ in range(repeats):
        start = clock.now()
        for _ in range(4):
            torch.mm(a, a)
        best = min(best, clock.elapsed(start, clock.now()))
    return best


@functools.lru_cache(maxsize=4)
def _calibration_input(kind: str, index: int | None) -> Tensor:
    size = CALIBRATION_SIZE.get(kind, CALIBRATION_SIZE["cuda"])
    generator = torch.Generator().manual_seed(0)
    return torch.rand(size, size, generator=generator).to(torch.device(kind, index) if index is not None else kind)


@dataclasses.dataclass
class LayerCost:
    """Measured cost of one layer for one micro-batch (times in seconds, memory in bytes).

    Attributes:
        fwd: forward time.
        bwd: backward time (with the recomputation of a checkpointed layer): ``bwd_input + bwd_weight``.
        activation_bytes: bytes the layer keeps for backward while the micro-batch is in flight.
        recompute_bytes: bytes a checkpointed layer's recomputation rebuilds during its backward (0 for the others).
        bwd_input: the backward's input part (gradients of the activations); all of it unless the schedule splits.
        bwd_weight: the backward's weight part (gradients of the parameters) under a zero-bubble schedule, else 0.
        input_bytes: its input activation of one micro-batch (what a stage starting at the layer receives).
        weight_copies_bytes: copies of its weights held for the step, once for all micro-batches: autocast's
            casts (bf16-mixed caches them for the whole step) or FSDP2's gathered weights.
    """

    fwd: float
    bwd: float
    activation_bytes: int
    recompute_bytes: int
    bwd_input: float = 0.0
    bwd_weight: float = 0.0
    input_bytes: int = 0
    weight_copies_bytes: int = 0


class LayerProfiler:
    """Times the layers of this process's stages during profiled steps.

    Args:
        device: the device the layers run on (selects the clock).
        clock: the clock to read instead of the device's (tests count time themselves).
    """

    def __init__(self, device: torch.device, clock: DeviceClock | None = None) -> None:
        self._clock = clock if clock is not None else DeviceClock(device)
        self.active = False
        self._reset()

    def _reset(self) -> None:
        self._calls = 0
        self._fwd: list[tuple[int, Any, Any]] = []
        self._gathers: list[tuple[int, Any, Any]] = []  # FSDP2 all-gathers, part of the layers' forward
        self._act: dict[int, int] = defaultdict(int)
        self._recompute: dict[int, int] = defaultdict(int)
        self._inputs: dict[int, int] = {}
        self._copies: dict[int, int] = defaultdict(int)
        self._copied: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self._events: list[tuple[str, Any, Any]] = []
        self._hooks: list[Any] = []
        self._seen_layers: set[int] = set()
        self._weighed_layers: set[int] = set()
        self._in_weight_pass = False

    def start(self) -> None:
        """Profile the following forward/backward passes (until :meth:`stop`)."""
        self._reset()
        self.active = True

    def run(self, layers: Sequence[nn.Module], first_index: int, x: Any, recompute: Container[int] = ()) -> Any:
        """Run one micro-batch through a stage's ``layers`` with instrumentation; returns the stage output.

        Layers whose global index is in ``recompute`` run checkpointed, as the stage runs them unprofiled.
        """
        call = self._calls
        self._calls += 1
        for offset, layer in enumerate(layers):
            index = first_index + offset
            if isinstance(layer, FSDPModule):
                # FSDP2 gathers the weights at the forward anyway (kept for the step under a pipeline): gathered
                # first, the hooks below watch the parameters autograd computes with, not the shards. The gather
                # is the layer's forward cost (once per step: the micro-batch that gathers pays it).
                gather = self._clock.now()
                layer.unshard()
                self._gathers.append((index, gather, self._clock.now()))
                self._copies[index] = sum(p.numel() * p.element_size() for p in layer.parameters())
            self._inputs[index] = sum(t.numel() * t.element_size() for t in as_tuple(x)
                                      if isinstance(t, Tensor) and t.is_floating_point())  # fmt: skip
            self._mark(x, (call, index))
            if not any(t.requires_grad for t in as_tuple(x) if isinstance(t, Tensor)):
                self._hook_params(index, layer, weight_pass=False)
            if torch.is_grad_enabled():
                self._hook_params(index, layer, weight_pass=True)
            pack, observe = self._counters(index, layer)
            start = self._clock.now()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                if index in recompute:
                    x = checkpointed_call(layer, x, on_save=observe)
                else:
                    x = call_layer(layer, x)
            self._fwd.append((index, start, self._clock.now()))
        self._mark(x, (call, first_index + len(layers)))
        return x

    def _counters(self, index: int, layer: nn.Module) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
        """Count what layer ``index`` saves for backward: a pack hook, and an observer of a checkpoint's saves.

        The pack hook adds to the activation bytes, the observer to the recompute bytes; each storage counts once
        (a checkpointed layer's input is kept, not rebuilt), parameters never. Storages are told apart by identity,
        not address: what a checkpoint saves is freed at once, and the next tensor may take its address.
        """
        # by identity, as the saved storages (fake tensors, which size models without memory, have no addresses)
        params = weakref.WeakSet(local_part(p).untyped_storage() for p in layer.parameters())
        own = {id(p) for p in layer.parameters()}
        seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

        def add(t: Tensor, into: dict[int, int]) -> None:
            # a DTensor's (tensor parallelism's) own storage has its whole logical size: its local part's is held
            storage = local_part(t).untyped_storage()
            if storage not in params and storage not in seen:
                seen.add(storage)
                into[index] += storage.nbytes()

        def copy(t: Tensor) -> bool:
            # a weight cast by autocast: cached for the whole step, shared by every micro-batch (also where the
            # layer is checkpointed: its recomputation finds the cast in the cache)
            if not _weight_copy(t, own):
                return False
            storage = local_part(t).untyped_storage()
            if storage not in self._copied:
                self._copied.add(storage)
                self._copies[index] += storage.nbytes()
            return True

        def pack(t: Tensor) -> Tensor:
            if not copy(t):
                add(t, self._act)
            return t

        def observe(t: Tensor) -> None:
            if not copy(t):
                add(t, self._recompute)

        return pack, observe

    def _mark(self, x: Any, key: tuple[int, int]) -> None:
        """Timestamp the gradient's arrival at boundary ``key = (call, layer whose input this is)``."""
        if not torch.is_grad_enabled():
            return
        for t in as_tuple(x):
            if isinstance(t, Tensor) and t.requires_grad:
                # Removed in `stop`: stage input buffers persist across steps.
                self._hooks.append(t.register_hook(lambda _g, key=key: self._stamp_boundary(key)))

    def _stamp_boundary(self, key: tuple[int, int]) -> None:
        # A weight pass runs through the activations' graph again: its arrivals are not the input pass's.
        if not self._in_weight_pass:
            self._stamp("boundary", key)

    def _stamp(self, kind: str, key: Any) -> None:
        self._events.append((kind, key, self._clock.now()))

    def _hook_params(self, index: int, layer: nn.Module, weight_pass: bool) -> None:
        """Hook every trainable parameter of ``layer``, once per layer.

        Outside a weight pass, the end of the layer's backward is marked by its parameter-gradient accumulation (its
        input has no grad); inside a :meth:`weight_pass`, every parameter gradient computed there is stamped.
        """
        hooked = self._weighed_layers if weight_pass else self._seen_layers
        if index in hooked:
            return
        hooked.add(index)
        for p in layer.parameters():
            if not p.requires_grad:
                continue
            if weight_pass:
                self._hooks.append(p.register_hook(lambda _g, index=index: self._stamp_weight(index)))
            else:
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(lambda _p, index=index: self._stamp("param", index))
                )

    def _stamp_weight(self, index: int) -> None:
        if self._in_weight_pass:  # a full backward computes the same gradients: its time is the boundaries'
            self._stamp("weight", index)

    @contextlib.contextmanager
    def weight_pass(self) -> Iterator[None]:
        """Around a stage's weight pass (``backward_weight_one_chunk``): its parameter gradients are timed."""
        if not self.active:
            yield
            return
        self._stamp("weight_pass", None)
        self._in_weight_pass = True
        try:
            yield
        finally:
            self._in_weight_pass = False

    def stop(self) -> dict[int, LayerCost]:
        """End profiling and return this process's measurements per layer index (per micro-batch averages)."""
        self.active = False
        for h in self._hooks:
            h.remove()
        fwd: dict[int, float] = defaultdict(float)
        calls: dict[int, int] = defaultdict(int)
        for index, start, end in self._fwd:
            fwd[index] += self._clock.elapsed(start, end)
            calls[index] += 1
        for index, start, end in self._gathers:
            fwd[index] += self._clock.elapsed(start, end)
        bwd, weight = self._backward_times(), self._weight_times()
        result = {
            i: LayerCost(
                fwd=fwd[i] / n,
                bwd=(bwd.get(i, 0.0) + weight.get(i, 0.0)) / n,
                activation_bytes=self._act[i] // n,
                recompute_bytes=self._recompute[i] // n,
                bwd_input=bwd.get(i, 0.0) / n,
                bwd_weight=weight.get(i, 0.0) / n,
                input_bytes=self._inputs.get(i, 0),
                weight_copies_bytes=self._copies[i],
            )
            for i, n in calls.items()
        }
        self._reset()
        return result

    def _backward_times(self) -> dict[int, float]:
        """Per layer, the summed backward time over all micro-batches, from the boundary/parameter events."""
        times: dict[tuple[int, int], Any] = {}
        param_end: dict[tuple[int, int], Any] = {}
        current_call = -1
        for kind, key, stamp in self._events:
            if kind in ("weight_pass", "weight"):
                continue  # see _weight_times
            if kind == "boundary":
                times[key] = stamp
                current_call = key[0]
            else:  # parameter gradient of layer `key`, during the backward of the latest boundary's call
                param_end[(current_call, key)] = stamp
        out: dict[int, float] = defaultdict(float)
        for (call, boundary), start in times.items():
            layer = boundary - 1  # the boundary after `layer` opens its backward
            end = times.get((call, layer), param_end.get((call, layer)))
            if end is not None and layer >= 0:
                out[layer] += max(0.0, self._clock.elapsed(start, end))
        return out

    def _weight_times(self) -> dict[int, float]:
        """Per layer, the summed weight-pass time: each gap between stamps of a pass counts for the later stamp."""
        out: dict[int, float] = defaultdict(float)
        previous = None
        for kind, key, stamp in self._events:
            if kind == "weight_pass":
                previous = stamp
            elif kind == "weight" and previous is not None:
                out[key] += max(0.0, self._clock.elapsed(previous, stamp))
                previous = stamp
        return out


def release_cached_memory(device: torch.device) -> None:
    """Return free memory to the system: CUDA's cached blocks for ``device``, and the host heap's free pages.

    Called once layers are dropped (the ones a migration sent away, a released process's); a collection first frees
    what only a reference cycle still held. On every device the host's allocator is trimmed too
    (:func:`release_host_memory`): a migration pickles and receives its layers through host memory.
    """
    if device.type == "cuda":
        gc.collect()
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    release_host_memory()


def release_host_memory() -> None:
    """Give the free pages of the host's heap back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    glibc keeps what a process freed in its heaps and arenas for reuse; after the large, short-lived buffers of a
    migration or a checkpoint (pickles, received tensors, write buffers) a long job's resident memory then creeps up
    although nothing leaks (``examples/soak.py``, ``docs/bench/soak.json``).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim`` (glibc), or ``None`` where it has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def device_memory(device: torch.device) -> int | None:
    """Bytes of a GPU ``device`` this process can hold: what is free there now, and what it holds already.

    The device's free memory (``torch.cuda.mem_get_info``: what other processes and the CUDA context hold is not
    free) plus this process's own reservation (``torch.cuda.memory_reserved``: its tensors, which the memory model
    counts against the capacity, and its allocator's cache, which they reuse). ``None`` elsewhere (CPU memory is
    the host's, not planned).
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


#: Autograd nodes a saved weight may sit behind (a transposed or reshaped view of the cast).
_VIEWS = ("TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward", "UnsafeViewBackward", "ExpandBackward")


def _weight_copy(t: Tensor, params: set[int]) -> bool:
    """Whether ``t`` is a cast of one of ``params`` (ids), possibly behind views: what autocast saves for a weight.

    Told by the autograd graph, not the shape (an activation can have a weight's shape: sequence = hidden size).
    """
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name.startswith("ToCopyBackward"):
            return any(getattr(nxt, "variable", None) is not None and id(nxt.variable) in params
                       for nxt, _ in fn.next_functions if nxt is not None)  # fmt: skip
        if not name.startswith(_VIEWS):
            return False
        fn = fn.next_functions[0][0]
    return False


def static_memory(layer: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int]:
    """Bytes of a layer's parameters (and buffers), of its gradients, and of its optimizer state on this process.

    Of a sharded layer (FSDP2) the shards this process holds: ``1/D`` of the whole over ``D`` replicas.
    """

    def size(t: Tensor) -> int:
        part = local_part(t)
        return part.numel() * part.element_size()

    params = sum(size(t) for t in (*layer.parameters(), *layer.buffers()))
    grads = sum(size(p) for p in layer.parameters() if p.requires_grad)
    optim = 0
    if optimizer is not None:
        for p in layer.parameters():
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, Tensor):
                    optim += size(v)
    return params, grads, optim
