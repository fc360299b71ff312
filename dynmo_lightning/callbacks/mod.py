"""MixtureOfDepths: routed blocks process only the top-k tokens of each sequence (Raposo et al., 2024).

Switches on routers in every ``every``-th block of the reference GPT (``GPT(mod_every=..)``; see
:mod:`dynmo_lightning.models.routing`) and schedules the capacity: dense (``start_capacity``, default 1 = every token,
exactly the dense model) until ``start_step``, then a linear anneal to ``capacity`` over ``anneal_steps`` — which is
what makes the routed blocks' cost drift during training. ``k`` per sequence is fixed by the capacity, so shapes stay
static. Logged every ``log_every_n_steps``: ``mod/layer{b}/routed_frac`` and ``mod/capacity``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, check_at_least, check_fractions
from dynmo_lightning.models.routing import DepthRouter
from dynmo_lightning.protocol import layers_changed, set_host_value


class MixtureOfDepths(RoutedDynamics, name="mod", part=DepthRouter, setting="routers in its blocks (GPT(mod_every=2))"):
    """Mixture of Depths with a capacity schedule.

    Args:
        capacity: target fraction of tokens a routed block processes, in (0, 1].
        every: route every ``every``-th block.
        start_capacity: capacity until ``start_step`` (1: dense).
        start_step: when annealing starts.
        anneal_steps: steps from ``start_capacity`` to ``capacity`` (0: at once).
        log_every_n_steps: steps between logs of the routed fractions and the capacity.
    """

    def __init__(
        self,
        capacity: float = 0.125,
        every: int = 2,
        start_capacity: float = 1.0,
        start_step: int = 20,
        anneal_steps: int = 100,
        log_every_n_steps: int = 10,
    ) -> None:
        check_fractions(capacity=capacity, start_capacity=start_capacity)
        check_at_least(1, every=every)
        check_at_least(0, start_step=start_step, anneal_steps=anneal_steps)
        super().__init__(log_every_n_steps, mod_every=every, mod_capacity=start_capacity)
        self.capacity = capacity
        self.every = every
        self.start_capacity = start_capacity
        self.start_step = start_step
        self.anneal_steps = anneal_steps
        self._routing: bool | None = None

    def capacity_at(self, step: int) -> float:
        """Capacity after ``step`` optimizer steps."""
        if step < self.start_step:
            return self.start_capacity
        t = 1.0 if self.anneal_steps == 0 else min(1.0, (step - self.start_step) / self.anneal_steps)
        return self.start_capacity + t * (self.capacity - self.start_capacity)

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
