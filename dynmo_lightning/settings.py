r"""Components configured by one settings dataclass each: keyword arguments in, the dataclass out.

A component (the balancer, the strategy, a dynamic) declares its settings once, as a ``@dataclass(kw_only=True)``
with a docstring under every field (``balance.decision.policy_settings.BalanceSettings``,
``callbacks.balancer.BalancerSettings``, ``pipeline.strategy_settings.StrategySettings``). Its ``__init__(self,
**kwargs)`` :func:`build`\ s the dataclass, so the Python API and the Hydra group (whose keys are the same fields, with
the same defaults, as ``tests/test_settings.py`` checks) cannot drift apart; :func:`configured_by` gives that
``__init__`` the fields as its signature, for type checkers (a ``ParamSpec``) and at run time (``help()``, IDEs,
LightningCLI). One settings object goes in through the component's ``from_settings`` (:func:`from_settings`). Standard
library only: every room may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

#: Settings of earlier releases and the names they have now (a call with the old name is refused, naming the new).
RENAMED = {"p2p": "p2p_seconds", "min_world_size": "min_stages"}

S = TypeVar("S")
C = TypeVar("C")
P = ParamSpec("P")


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


def values(settings: object) -> dict[str, Any]:
    """A settings dataclass's fields by name, shallow (callables and lists stay the objects they are)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}  # type: ignore[arg-type]


def from_settings(
    component: Callable[..., C], settings_class: type, settings: object, overrides: Mapping[str, Any]
) -> C:
    """``component(**fields of settings, **overrides)``: a component built from one settings object.

    Raises:
        TypeError: ``settings`` is no ``settings_class``.
    """
    if not isinstance(settings, settings_class):
        name = getattr(component, "__name__", str(component))
        raise TypeError(f"{name}.from_settings takes a {settings_class.__name__}, got {type(settings).__name__}")
    return component(**(values(settings) | dict(overrides)))


def configured_by(
    settings: Callable[P, object],
) -> Callable[[Callable[..., None]], Callable[Concatenate[Any, P], None]]:
    """Give a component's ``__init__(self, **kwargs)`` the signature of ``settings``' fields, for every reader.

    Static checkers and IDEs read the ``ParamSpec``: ``DynMoBalancer(every_n_step=3)`` is an error for mypy and
    pyright, and a wrong type too. At run time ``__signature__`` lists the fields as typed keyword-only parameters
    (annotations resolved), which is what ``help()``, ``inspect`` and LightningCLI's jsonargparse read, so a
    ``class_path`` + ``init_args`` config builds the component. No positional parameter: jsonargparse takes every
    positional-only one as required.
    """

    def decorate(init: Callable[..., None]) -> Callable[Concatenate[Any, P], None]:
        hints = typing.get_type_hints(settings)
        own = list(inspect.signature(init).parameters.values())[:1]  # self
        fields = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty,
                annotation=hints.get(f.name, f.type),
            )
            for f in dataclasses.fields(settings)  # type: ignore[arg-type]
        ]
        init.__signature__ = inspect.Signature([*own, *fields], return_annotation=None)  # type: ignore[attr-defined]
        return init

    return decorate
