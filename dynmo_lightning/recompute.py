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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dynmo_lightning.protocol import call_layer, probing, runs_without_autograd, stage_forward, stage_memo

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
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


@contextlib.contextmanager
def _replay(memo: dict[str, Any] | None) -> Iterator[None]:
    """Around a recomputation: the stage memo the layer's forward saw, and no statistics counted a second time."""
    with probing():
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
