"""Compiled pipeline layers: ``DynMoStrategy(compile=True | {options})`` compiles every layer in place.

Each layer's ``forward`` is replaced on the instance by its compiled version (the module stays the
module: names, optimizer groups and checkpoint keys are the unsplit model's). Only ``forward`` is compiled, not the
module call: the hooks around it (FSDP2's gathers, the profiler's timers, activation checkpointing, which calls the
layer) stay eager, so each composes with a compiled layer as with an eager one. Identical blocks share the compiled
code (dynamo caches per code object and guards on the module's type and attributes, not its identity), which
:func:`graphs` counts.

A layer dynamo gives up on is never eager in silence: past dynamo's recompile limit (8 graphs of one function, e.g.
``Block.forward``) dynamo runs that function eagerly wherever no compiled graph fits, and says so only in its log;
the layer whose call hit the limit is then named in a ``RuntimeWarning`` with dynamo's reason (:func:`compile_layer`).

A compiled forward does not pickle: a migrating layer travels without it (:func:`reduce_compiled`) and is compiled
again on arrival. Under the zero-bubble schedules a compiled layer's backward is one AOTAutograd graph, which cannot
run as separate input and weight parts: those stages run their backward whole in the input pass (the schedule's
order stands; its weight tasks are empty for them).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: Marks a layer whose ``forward`` was compiled here (the options it was compiled with).
COMPILED = "_dynmo_compiled"


#: ``torch.compile`` modes that capture CUDA graphs (``torch._inductor.list_mode_options``, torch 2.9 to 2.13), and
#: the mode to use instead.
_CUDAGRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def check_options(value: Any) -> dict[str, Any] | None:
    """``DynMoStrategy(compile=...)`` as ``torch.compile``'s keyword arguments (``None``: eager).

    Raises:
        ValueError: neither a bool nor a dict of ``torch.compile``'s options, or options that turn on CUDA graphs
            (:func:`_cudagraphs`).
    """
    if value is None or value is False:
        return None
    if value is True:
        options: dict[str, Any] = {}
    elif isinstance(value, dict) or hasattr(value, "items"):
        options = dict(value)
        allowed = {"fullgraph", "dynamic", "backend", "mode", "options", "disable"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(
                f"strategy.compile has unknown torch.compile options {unknown}; allowed: {sorted(allowed)}"
            )
    else:
        raise ValueError(f"strategy.compile={value!r} must be false, true or a dict of torch.compile options")
    refused = _cudagraphs(options)
    if refused is not None:
        setting, fix = refused
        raise ValueError(
            f"strategy.compile {setting} turns on CUDA graphs, which pipeline training does not support (its "
            f"schedule keeps several micro-batches' outputs alive across replays, FSDP2 frees and re-allocates "
            f"parameter storage): {fix}"
        )
    return options


def _cudagraphs(options: dict[str, Any]) -> tuple[str, str] | None:
    """The setting among ``torch.compile`` ``options`` that turns on CUDA graphs, and its fix; ``None``: none does.

    A mode that captures them, inductor's ``triton.cudagraphs`` option, the ``"cudagraphs"`` backend, or inductor's
    process-wide switch (``TORCHINDUCTOR_CUDAGRAPHS=1``) where no option turns it off.
    """
    mode, inductor, backend = options.get("mode"), options.get("options") or {}, options.get("backend")
    if mode in _CUDAGRAPH_MODES:
        return f"mode={mode!r}", f"use mode {_CUDAGRAPH_MODES[mode]!r}"
    if inductor.get("triton.cudagraphs"):
        return "options={'triton.cudagraphs': True}", "leave that option out"
    if backend == "cudagraphs":
        return "backend='cudagraphs'", "use the default backend ('inductor')"
    if os.environ.get("TORCHINDUCTOR_CUDAGRAPHS") == "1" and backend in (None, "inductor"):
        if inductor.get("triton.cudagraphs") is None:
            return "under TORCHINDUCTOR_CUDAGRAPHS=1", "unset it, or pass options={'triton.cudagraphs': False}"
    return None


def compile_layer(layer: nn.Module, options: dict[str, Any], name: str | None = None) -> None:
    """Compile ``layer``'s ``forward`` in place (once: a compiled layer is left as it is).

    Args:
        layer: the module whose ``forward`` is compiled.
        options: ``torch.compile``'s keyword arguments (:func:`check_options`).
        name: what a warning calls the layer, e.g. its pipeline index (default: its class's name).
    """
    if getattr(layer, COMPILED, None) is not None:
        return
    _watch_dynamo()
    compiled = torch.compile(layer.forward, **options)
    layer.forward = _named(compiled, name or type(layer).__name__)  # type: ignore[method-assign]
    setattr(layer, COMPILED, dict(options))


def _named(compiled: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``compiled``, which says while it runs that layer ``name`` is running (for :class:`_GiveUpWarning`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        global _running
        outer, _running = _running, name
        try:
            return compiled(*args, **kwargs)
        finally:
            _running = outer

    return forward


#: The compiled layer whose forward runs now (its name), if any: dynamo compiles a frame inside the call that runs it.
_running: str | None = None

#: The logger of dynamo's frame conversion, where it says that it hit a recompile limit (torch 2.9 to 2.13).
_DYNAMO_LOG = "torch._dynamo.convert_frame"


class _GiveUpWarning(logging.Filter):
    """Turns dynamo's "hit config.recompile_limit" log record into a warning that names the running layer.

    Dynamo logs it once per function that hits the limit (and only logs it): from then on the function runs eagerly
    wherever none of its graphs fits. A filter (it lets every record through) sees the record inside the call of the
    layer whose forward hit the limit, also where the limit is that of a function it calls or of a resumption after a
    graph break.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if _running is not None and str(record.msg).startswith("torch._dynamo hit config."):
            # "torch._dynamo hit config.recompile_limit (8)", "function: 'forward' (file:line)", "last reason: ..."
            limit, function, reason, *_ = (*(line.strip() for line in record.getMessage().splitlines()), "", "")
            warnings.warn(
                f"torch.compile gave up on layer {_running}, which runs eagerly from now on wherever none of its "
                f"compiled graphs fits: dynamo {limit.removeprefix('torch._dynamo ')}, {function}; {reason}",
                RuntimeWarning,
                stacklevel=1,  # the caller is logging's machinery
            )
        return True


_GIVE_UP = _GiveUpWarning()


def _watch_dynamo() -> None:
    """Have :class:`_GiveUpWarning` watch dynamo's log (once)."""
    log = logging.getLogger(_DYNAMO_LOG)
    if _GIVE_UP not in log.filters:
        log.addFilter(_GIVE_UP)


def is_compiled(layer: nn.Module) -> bool:
    """Whether :func:`compile_layer` compiled ``layer``."""
    return getattr(layer, COMPILED, None) is not None


def reduce_compiled(obj: Any) -> Any:
    """``Pickler.reducer_override``: a compiled layer as its eager self (``NotImplemented`` for anything else)."""
    if not isinstance(obj, nn.Module) or getattr(obj, COMPILED, None) is None:
        return NotImplemented
    state = {k: v for k, v in obj.__dict__.items() if k not in ("forward", COMPILED)}
    return _new_module, (type(obj),), state


def _new_module(cls: type) -> nn.Module:
    return cls.__new__(cls)


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
