r"""Components configured by one settings dataclass each: keyword arguments in, the dataclass out.

A component (the balancer, the strategy) declares its settings once, as a ``@dataclass(kw_only=True)`` with a
docstring under every field (``balance.settings.BalanceSettings``, ``callbacks.balancer.BalancerSettings``,
``pipeline.settings.StrategySettings``). Its ``__init__`` takes ``**settings`` and :func:`build`\ s the dataclass,
so the Python API and the Hydra group (whose keys are the same fields, with the same defaults, as
``tests/test_settings.py`` checks) cannot drift apart; :func:`with_settings_signature` shows the fields in the
component's signature (``help()``, IDEs, ``inspect``). Standard library only: every room may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

#: Settings of earlier releases and the names they have now (a call with the old name is refused, naming the new).
RENAMED = {"p2p": "p2p_seconds", "min_world_size": "min_stages"}

S = TypeVar("S")


def build(cls: type[S], component: str, group: str, settings: Mapping[str, Any]) -> S:
    """``cls(**settings)``, refusing an unknown or renamed keyword with the fix in Python and in Hydra.

    Args:
        cls: a settings dataclass.
        component: the class whose arguments these are (for the message), e.g. ``"DynMoBalancer"``.
        group: its Hydra group, e.g. ``"balancer"``.
        settings: the keyword arguments.

    Raises:
        TypeError: a keyword is no field of ``cls``.
    """
    check_names(cls, component, group, settings)
    return cls(**settings)


def check_names(cls: type, component: str, group: str, settings: Mapping[str, Any]) -> None:
    """Refuse a keyword that is no field of ``cls`` (see :func:`build`)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    for name in settings:
        if name in fields:
            continue
        if name in RENAMED and RENAMED[name] in fields:
            hint = f"it is now {RENAMED[name]!r} ({component}({RENAMED[name]}=...), Hydra {group}.{RENAMED[name]})"
        else:
            near = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean {near[0]!r} (Hydra {group}.{near[0]})?" if near else f"settings: {fields}"
        raise TypeError(f"{component}() got an unknown setting {name!r} (Hydra {group}.{name}): {hint}")


def resolve(cls: type[S], component: str, group: str, settings: S | None, overrides: Mapping[str, Any]) -> S:
    """A component's settings from ``Component(settings)``, ``Component(**overrides)`` or both (overrides win)."""
    if settings is None:
        return build(cls, component, group, overrides)
    if not isinstance(settings, cls):
        raise TypeError(f"{component}(settings) takes a {cls.__name__}, got {type(settings).__name__}")
    if overrides:
        check_names(cls, component, group, overrides)
        return dataclasses.replace(settings, **overrides)  # type: ignore[type-var]
    return settings


def fields_signature(settings: type, own: inspect.Signature) -> inspect.Signature:
    """``own`` (a component's ``__init__``) with ``settings``' fields keyword-only, and its ``**kwargs`` dropped.

    The result reads ``(self, settings=None, /, *, <fields>, <other arguments>)``.
    """
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    lead = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    rest = [p for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
    fields = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty,
            annotation=f.type,
        )
        for f in dataclasses.fields(settings)
    ]
    return inspect.Signature([*lead, *fields, *rest], return_annotation=None)


def with_settings_signature(settings: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate ``__init__(self, settings=None, /, *, <other arguments>, **kwargs)`` to show ``settings``' fields.

    See :func:`fields_signature`.
    """

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        init.__signature__ = fields_signature(settings, inspect.signature(init))  # type: ignore[attr-defined]
        return init

    return decorate
