"""MixtureOfDepths: routed blocks process only the top-k tokens of each sequence (Raposo et al., 2024).

Switches on routers in every ``every``-th block of the reference GPT (``GPT(mod_every=..)``; see
:mod:`dynmo_lightning.models.routing`) and schedules the capacity: dense (``start_capacity``, default 1 = every token,
exactly the dense model) until ``start_step``, then a linear anneal to ``capacity`` over ``anneal_steps`` — which is
what makes the routed blocks' cost drift during training. ``k`` per sequence is fixed by the capacity, so shapes stay
static. Logged every ``log_every_n_steps``: ``mod/layer{b}/routed_frac`` and ``mod/capacity``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import lightning.pytorch as pl
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, RoutedSettings, check_at_least, check_fractions
from dynmo_lightning.core.callback_tools import layers_changed
from dynmo_lightning.core.host_values import set_host_value
from dynmo_lightning.models.routing import DepthRouter
from dynmo_lightning.settings import configured_by


@dataclasses.dataclass(kw_only=True)
class MoDSettings(RoutedSettings):
    """:class:`MixtureOfDepths`' settings (Hydra: ``conf/dynamics/mod.yaml``)."""

    capacity: float = 0.125
    """Target fraction of tokens a routed block processes, in (0, 1]: the top ``capacity`` share of every sequence
    by the router's score (a static ``k``, so shapes stay fixed); the others skip the block on the residual."""
    every: int = 2
    """Route every ``every``-th block (the MoD paper: every other one)."""
    start_capacity: float = 1.0
    """Capacity until ``start_step`` (1: dense, exactly the dense model)."""
    start_step: int = 20
    """When the anneal from ``start_capacity`` to ``capacity`` starts."""
    anneal_steps: int = 100
    """Steps of the linear anneal from ``start_capacity`` to ``capacity`` (0: at once at ``start_step``); the
    routed blocks' cost drifts along it, which the balancer follows."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fractions(capacity=self.capacity, start_capacity=self.start_capacity)
        check_at_least(1, every=self.every)
        check_at_least(0, start_step=self.start_step, anneal_steps=self.anneal_steps)


class MixtureOfDepths(RoutedDynamics, name="mod", part=DepthRouter, settings=MoDSettings):
    """Mixture of Depths with a capacity schedule; set by :class:`MoDSettings` (its fields as keywords, or one)."""

    settings: MoDSettings
    options: ClassVar[dict[str, str]] = {"mod_every": "every", "mod_capacity": "start_capacity"}

    @configured_by(MoDSettings)
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._routing: bool | None = None

    def capacity_at(self, step: int) -> float:
        """Capacity after ``step`` optimizer steps."""
        s = self.settings
        if step < s.start_step:
            return s.start_capacity
        t = 1.0 if s.anneal_steps == 0 else min(1.0, (step - s.start_step) / s.anneal_steps)
        return s.start_capacity + t * (s.capacity - s.start_capacity)

    @override
    def before_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        capacity = self.capacity_at(step)
        for _, router in self.parts(pl_module):
            set_host_value(router, "capacity", capacity)
        routing = capacity < 1.0
        if routing != self._routing:
            # Below capacity 1 the routers join the auxiliary loss, so the carried loss starts to need gradients
            # across stage boundaries: the pipeline must rebuild its stages.
            self._routing = routing
            layers_changed(trainer)

    @override
    def layer_stats(self, local: list[tuple[int, DepthRouter]]) -> dict[int, tuple[int, int]]:
        stats = {i: (r.routed, r.seen) for i, r in local}  # host counters: no device read
        for _, router in local:
            router.routed = router.seen = 0
        return stats

    @override
    def layer_metrics(self, stats: dict[int, tuple[int, int]]) -> dict[int, dict[str, float]]:
        return {i: {"routed_frac": r / s} for i, (r, s) in stats.items() if s}

    @override
    def model_metrics(self, stats: dict[int, tuple[int, int]], step: int) -> dict[str, float]:
        return {"capacity": self.capacity_at(step)}
