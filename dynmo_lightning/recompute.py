"""Activation checkpointing: which pipeline layers recompute their activations in backward, and how one does.

A checkpointed layer keeps only its inputs for backward; when the gradient reaches it, its forward runs again
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) to rebuild what it would have saved. The
activations a stage holds for its in-flight micro-batches shrink to the checkpointed layers' inputs, for a second
forward of those layers in backward.

Nothing wraps the layer: the code that runs a stage's layers (``StageModule``, and the profiler on profiled steps)
calls a chosen layer through :func:`checkpointed_call`, so the modules and state-dict keys stay the unsplit model's.
The choice (:func:`checkpoint_policy`) is a function of the layer's global index and the layer, made whenever a
stage is built, so it follows a layer wherever migration or a repack takes it.

The recomputation repeats the forward exactly, or non-reentrant checkpointing would refuse the recomputed tensors
(their shapes follow host-side decisions) or, worse, compute other gradients:

* random numbers: the RNG state is saved and restored (``preserve_rng_state``), so dropout draws the same masks;
* host-side decisions: a dynamic layer may read values that earlier layers of the stage left in the stage's memo
  (:func:`~dynmo_lightning.protocol.stage_memo`: early exit's bound on the active tokens). Backward runs outside
  the stage's forward, so the memo as the layer saw it is copied before the layer runs and replayed around its
  recomputation. Memo values are replaced, never changed in place, so a shallow copy is the memo of that moment.
  Values read from buffers (thresholds, densities, capacities) only change between steps;
* statistics: the recomputation runs under :func:`~dynmo_lightning.protocol.probing`, so layers count exits, routed
  tokens, attention coverage and expert loads of the forward once, not again in backward.

A layer that runs without autograd (evaluation; a frozen layer whose inputs carry no gradient) has nothing to
recompute and runs plainly.

Under the zero-bubble schedules a stage's backward runs in two passes over the same graph, the input pass (gradients
of the stage's inputs) and later the weight pass (of its parameters). torch's checkpoint recomputes once per
backward pass (it keys what it recomputed by the autograd graph task, and frees each tensor as it is used), so a
layer would run three times. Inside :func:`shared_recomputation` a checkpointed layer instead recomputes once, at
the first pass that needs it, and keeps what it rebuilt for the other pass until the graph is freed (after the
weight pass): one recomputation per micro-batch, as under 1F1B. :func:`recomputations` counts them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from dynmo_lightning.core.context import probing, stage_forward, stage_memo
from dynmo_lightning.core.layer_calls import call_layer, runs_without_autograd

#: Which layers a stage recomputes: ``(global layer index, layer) -> bool``.
Policy = Callable[[int, nn.Module], bool]

_HELP = (
    "use None (off), 'all' (every pipeline layer), a positive integer k (every k-th pipeline layer: indices k-1, "
    "2k-1, ...) or a callable (index, layer) -> bool"
)


def checkpoint_policy(setting: Any) -> Policy | None:
    """The layer predicate of a ``DynMoStrategy(activation_checkpointing=...)`` setting (``None``: off).

    Args:
        setting: ``None`` (off), ``"all"`` (every pipeline layer), a positive integer ``k`` (every ``k``-th pipeline
            layer, counting the embedding: global indices ``k - 1, 2k - 1, ...``), or a callable
            ``(index, layer) -> bool`` called with a layer's global index and the layer whenever a stage is built.

    Raises:
        ValueError: any other setting, or a callable that cannot be called with ``(index, layer)``; the message
            names ``strategy.activation_checkpointing`` and what to use.
    """
    if setting is None:
        return None
    if isinstance(setting, str):
        if setting != "all":
            raise ValueError(f"strategy.activation_checkpointing={setting!r} is not a known setting: {_HELP}")
        return functools.partial(_every, 1)
    if isinstance(setting, bool) or (isinstance(setting, int) and setting < 1):
        raise ValueError(
            f"strategy.activation_checkpointing={setting!r} must be a positive integer k (every k-th layer; 1 is "
            f"every layer); {_HELP}"
        )
    if isinstance(setting, int):
        return functools.partial(_every, setting)
    if not callable(setting):
        raise ValueError(f"strategy.activation_checkpointing={setting!r} has an unusable type: {_HELP}")
    _check_signature(setting)
    return setting


def _every(k: int, index: int, layer: nn.Module) -> bool:
    return index % k == k - 1


def _check_signature(predicate: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(predicate)
    except (TypeError, ValueError):
        return  # a builtin or extension callable without a signature: it answers for itself when called
    try:
        signature.bind(0, nn.Identity())
    except TypeError as error:
        name = getattr(predicate, "__qualname__", repr(predicate))
        raise ValueError(
            f"strategy.activation_checkpointing={name}{signature} cannot be called as (index, layer) ({error}): "
            "give a callable taking a layer's global index and the layer, returning True for the layers to "
            "recompute, e.g. `lambda index, layer: isinstance(layer, Block)`"
        ) from None


_count = [0]
_shared = [False]


def recomputations() -> int:
    """Forwards this process has recomputed for backward so far (one per checkpointed layer and micro-batch)."""
    return _count[0]


@contextlib.contextmanager
def shared_recomputation(enabled: bool = True) -> Iterator[None]:
    """Within: checkpointed layers recompute once for every backward pass over their graph (see the module doc)."""
    before, _shared[0] = _shared[0], enabled
    try:
        yield
    finally:
        _shared[0] = before


def checkpointed_call(layer: nn.Module, x: Any, on_save: Callable[[Tensor], None] | None = None) -> Any:
    """Apply ``layer`` as :func:`~dynmo_lightning.protocol.call_layer` does, recomputing its activations in backward.

    Args:
        layer: the layer.
        x: its input (a tensor, or a tuple unpacked into positional arguments).
        on_save: called with every tensor the layer saves for backward inside the checkpoint (the tensors its
            recomputation rebuilds); the profiler counts them.
    """
    if not torch.is_grad_enabled() or runs_without_autograd(layer, x):
        return call_layer(layer, x)
    memo = stage_memo()
    seen = None if memo is None else dict(memo)
    spread = isinstance(x, tuple)

    def run(*args: Any) -> Any:
        return call_layer(layer, args if spread else args[0])

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return (contextlib.nullcontext() if on_save is None else _observe_saves(on_save)), _replay(seen)

    args = x if spread else (x,)
    if _shared[0]:
        return _checkpoint_once(run, args, contexts)
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


class _Frame:
    """One checkpointed call: its inputs and the states to repeat it, and what its recomputation rebuilt."""

    def __init__(self, run: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.run = run
        # Detached, with the inputs' requires_grad: the recomputation saves what the forward saved, no more.
        self.args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a for a in args)
        tensors = [a for a in args if isinstance(a, Tensor)]
        # As torch's checkpoint: the RNG of the CPU and of the inputs' accelerator, and autocast on both.
        self.kind = next((t.device.type for t in tensors if t.device.type != "cpu"), None)
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = get_device_states(*tensors) if self.kind else ([], [])
        self.autocast = [(k, _autocast_of(k)) for k in ("cpu", self.kind) if k is not None]
        self.saved = 0
        self.rebuilt: list[Tensor] | None = None

    def rebuild(self, recompute_context: contextlib.AbstractContextManager) -> list[Tensor]:
        if self.rebuilt is not None:
            return self.rebuilt
        rebuilt: list[Tensor] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices, device_type=self.kind or "cuda"))
            torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng, device_type=self.kind)
            stack.enter_context(torch.enable_grad())
            for kind, kwargs in self.autocast:
                stack.enter_context(torch.autocast(kind, **kwargs))
            stack.enter_context(recompute_context)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: rebuilt.append(t.detach()), _no))
            self.run(*self.args)
        if len(rebuilt) != self.saved:
            raise RuntimeError(
                f"a checkpointed layer saved {len(rebuilt)} tensors when recomputed for backward but {self.saved} in "
                "its forward: its forward must repeat exactly (no host-side decisions that change between them)"
            )
        self.rebuilt, self.run, self.args = rebuilt, None, ()  # type: ignore[assignment]
        return rebuilt


def _autocast_of(kind: str) -> dict[str, Any]:
    return {
        "enabled": torch.is_autocast_enabled(kind),
        "dtype": torch.get_autocast_dtype(kind),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def _no(_: Any) -> Tensor:
    raise RuntimeError("the graph of a recomputation is only read for its saved tensors")


def _checkpoint_once(
    run: Callable[..., Any],
    args: tuple[Any, ...],
    contexts: Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]],
) -> Any:
    """Non-reentrant checkpointing whose recomputation serves every backward pass over the graph.

    The forward saves an index per tensor it would keep; the first unpack recomputes the call and keeps every tensor
    it saves, which the indices then read, in every pass. The frame lives as long as the graph's saved tensors (the
    hooks hold it), so what was rebuilt is freed with the graph.
    """
    frame = _Frame(run, args)
    forward_context, recompute_context = contexts()

    def pack(t: Tensor) -> int:
        frame.saved += 1
        return frame.saved - 1

    def unpack(i: int) -> Tensor:
        return frame.rebuild(recompute_context)[i]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), forward_context:
        return run(*args)


@contextlib.contextmanager
def _replay(memo: dict[str, Any] | None) -> Iterator[None]:
    """Around a recomputation: the stage memo the layer's forward saw, and no statistics counted a second time."""
    with probing():
        _count[0] += 1
        if memo is None:
            yield
            return
        with stage_forward() as replayed:
            replayed.update(memo)
            yield


@contextlib.contextmanager
def _observe_saves(on_save: Callable[[Tensor], None]) -> Iterator[None]:
    """Show ``on_save`` every tensor that the checkpoint's own saved-tensor hooks (on top of the stack) receive.

    The checkpoint's hooks turn saved tensors into placeholders that its recomputation fills in; a public hook pushed
    here would replace them. The stack's top pair is read instead (``torch._C._autograd``, no public reader) and
    called from a hook that first shows the tensor, so what is saved, and how, does not change.
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert top is not None, "only called inside a checkpointed forward, under its saved-tensor hooks"
    pack, unpack = top

    def observed(t: Tensor) -> Any:
        on_save(t)
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(observed, unpack):
        yield
