"""What the dynamics callbacks share: :class:`RoutedDynamics`, the base of the routed ones, and its pieces.

The pieces: checking settings, enabling a model's dynamic structure, finding its parts, gathering their statistics.

Metric names, every dynamic alike: ``<dynamic>/<metric>`` for the whole model, ``<dynamic>/layer{i}/<metric>`` for
pipeline layer ``i`` (the embedding is layer 0, so block ``b`` is layer ``b``); ``<dynamic>`` is the name of its
Hydra config (``dynamics=<dynamic>``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import Self, override

from dynmo_lightning.core.callback_tools import all_gather, local_layers
from dynmo_lightning.settings import build, from_settings


def check_fractions(**values: float) -> None:
    """Raise unless every setting ``dynamics.<name>=<value>`` is in (0, 1]."""
    for name, value in values.items():
        if not 0.0 < value <= 1.0:
            raise ValueError(f"dynamics.{name}={value} must be in (0, 1]")


def check_at_least(minimum: int, **values: int) -> None:
    """Raise unless every setting ``dynamics.<name>=<value>`` is at least ``minimum``."""
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"dynamics.{name}={value} must be >= {minimum}")


def enable(pl_module: pl.LightningModule, part: type[nn.Module], **options: Any) -> None:
    """Ask the model to build its layers with ``options`` (before ``configure_model``), then check ``part`` exists.

    Models that build dynamic parts themselves (no ``configure_dynamics``) just need to contain ``part`` modules.

    Raises:
        ValueError: the model has no ``part`` modules after all (naming the reference GPT's settings that add them).
    """
    configure = getattr(pl_module, "configure_dynamics", None)
    if callable(configure):
        configure(**options)
    elif not parts(pl_module, part):
        gpt = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ValueError(
            f"{type(pl_module).__name__} has no {part.__name__} modules in its pipeline layers: build them into its "
            f"blocks (the reference GPT's configure_dynamics does it for you: GPT({gpt}))"
        )


def parts(pl_module: pl.LightningModule, part: type[nn.Module]) -> list[tuple[int, nn.Module]]:
    """``(layer index, module)`` of every ``part`` module in the layers this process holds."""
    if getattr(pl_module, "blocks", ...) is None:  # layers not built yet
        return []
    return [(i, m) for i, layer in local_layers(pl_module) for m in layer.modules() if isinstance(m, part)]


def gather(local: dict[int, Any], trainer: pl.Trainer) -> dict[int, Any]:
    """Merge ``{layer index: value}`` of every process (each holds different layers).

    Values are statistics of the data (numbers, tensors or tuples of them): with data-parallel replicas, which see
    different data, each layer's value is the mean over the replicas (they train on equal numbers of samples).
    """
    by_replica = all_gather(local, trainer, replicas=True)
    merged = [{i: v for part_ in replica for i, v in part_.items()} for replica in by_replica]
    return {i: _mean([m[i] for m in merged]) for i in merged[0]}


def _mean(values: list[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    first = values[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_mean(list(parts)) for parts in zip(*values, strict=True))
    if isinstance(first, torch.Tensor):
        return torch.stack([v.float() for v in values]).mean(0)
    if isinstance(first, (int, float)):
        return sum(values) / len(values)
    return first


@dataclasses.dataclass(kw_only=True)
class RoutedSettings:
    """What every routed dynamic is set by (Hydra: keys of its ``conf/dynamics/<name>.yaml``)."""

    log_every_n_steps: int = 10
    """Steps between logs of the layers' statistics."""

    def __post_init__(self) -> None:
        check_at_least(1, log_every_n_steps=self.log_every_n_steps)


class RoutedDynamics(Callback):
    """Base of the dynamics whose layers route tokens or attention (early exit, MoD, MoE, sparse attention).

    As Lightning's ``BaseFinetuning``: the hooks are here, a subclass overrides a few methods. In ``setup`` the model
    is asked to build its ``part`` modules (with :meth:`model_options`: the class's :attr:`options`, each the value of
    a settings field, and its :attr:`fixed_options`); before every training step
    :meth:`before_step` may set their values; every ``log_every_n_steps`` steps :meth:`layer_stats` reads each local
    part's statistics, which are merged over the processes (:func:`gather`) and turned into metrics by
    :meth:`layer_metrics` and :meth:`model_metrics`, logged as ``<name>/layer{i}/<metric>`` and ``<name>/<metric>``.

    A subclass names, as class keywords, ``name`` (the metric prefix, its Hydra config's name), ``part`` (the module
    type it switches on) and ``settings`` (its settings dataclass, a :class:`RoutedSettings`: one name and one default
    per setting, the keys of its Hydra file):
    ``class MixtureOfExperts(RoutedDynamics, name="moe", part=MoEMLP, settings=MoESettings)``, and gives its
    ``__init__`` the settings' fields as its signature (``@configured_by(MoESettings)``, read by type checkers and
    LightningCLI). It is built from the settings' fields as keyword arguments, or from one settings object:
    ``MixtureOfExperts(n_experts=8)``, ``MixtureOfExperts.from_settings(MoESettings(n_experts=8))``.
    """

    name: ClassVar[str]
    part: ClassVar[type[nn.Module]]
    settings_class: ClassVar[type[RoutedSettings]]
    #: The model's ``configure_dynamics`` options that build ``part``, each with the settings field it takes.
    options: ClassVar[dict[str, str]] = {}
    #: Options of a fixed value (``{"attention": "sparse"}``).
    fixed_options: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, *, name: str, part: type[nn.Module], settings: type[RoutedSettings], **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.name, cls.part, cls.settings_class = name, part, settings

    def __init__(self, **kwargs: Any) -> None:
        cls = type(self)
        self.settings = build(cls.settings_class, cls.__name__, "dynamics", kwargs)
        self.log_every_n_steps = self.settings.log_every_n_steps

    @classmethod
    def from_settings(cls, settings: RoutedSettings, **overrides: Any) -> Self:
        """The callback of one settings object of its ``settings_class`` (``overrides`` replace some fields)."""
        return from_settings(cls, cls.settings_class, settings, overrides)

    def model_options(self) -> dict[str, Any]:
        """The model's ``configure_dynamics`` options that build ``part`` (its constructor arguments)."""
        return self.fixed_options | {option: getattr(self.settings, field) for option, field in self.options.items()}

    def parts(self, pl_module: pl.LightningModule) -> list[tuple[int, nn.Module]]:
        """``(layer index, part)`` of every ``part`` module this process holds."""
        return parts(pl_module, self.part)

    def before_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Set the parts' values for training step ``step`` (nothing by default)."""

    def layer_stats(self, local: list[tuple[int, nn.Module]]) -> dict[int, Any]:
        """Statistics since the last log of this process's ``(layer, part)`` pairs, by layer (and reset them)."""
        return {}

    def layer_metrics(self, stats: dict[int, Any]) -> dict[int, dict[str, float]]:
        """``{layer: {metric: value}}`` from every layer's gathered statistics."""
        return {}

    def model_metrics(self, stats: dict[int, Any], step: int) -> dict[str, float]:
        """Whole-model metrics at ``step`` from every layer's gathered statistics (none by default)."""
        return {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        enable(pl_module, self.part, **self.model_options())

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self.before_step(trainer, pl_module, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps:
            return
        stats = gather(self.layer_stats(self.parts(pl_module)), trainer)
        metrics = {
            f"{self.name}/layer{i}/{metric}": value
            for i, layer in sorted(self.layer_metrics(stats).items())
            for metric, value in layer.items()
        }
        model = self.model_metrics(stats, trainer.global_step)
        metrics |= {f"{self.name}/{metric}": value for metric, value in model.items()}
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
