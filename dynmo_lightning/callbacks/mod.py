"""MixtureOfDepths: routed blocks process only the top-k tokens of each sequence (Raposo et al., 2024).

Switches on routers in every ``every``-th block of the reference GPT (``GPT(mod_every=..)``; see
:mod:`dynmo_lightning.models.routing`) and schedules the capacity: dense (``start_capacity``, default 1 = every token,
exactly the dense model) until ``start_step``, then a linear anneal to ``capacity`` over ``anneal_steps`` — which is
what makes the routed blocks' cost drift during training. ``k`` per sequence is fixed by the capacity, so shapes stay
static. Logged every ``log_every_n_steps``: ``dynamics/routed_frac_block{b}`` and ``dynamics/capacity``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import enable, gather, parts
from dynmo_lightning.models.routing import DepthRouter
from dynmo_lightning.protocol import layers_changed, set_host_value


class MixtureOfDepths(Callback):
    """Mixture of Depths with a capacity schedule.

    Args:
        capacity: target fraction of tokens a routed block processes, in (0, 1].
        every: route every ``every``-th block.
        start_capacity: capacity until ``start_step`` (1: dense).
        start_step: when annealing starts.
        anneal_steps: steps from ``start_capacity`` to ``capacity`` (0: at once).
        log_every_n_steps: logging interval.
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
        for name, value in (("capacity", capacity), ("start_capacity", start_capacity)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"dynamics.{name}={value} must be in (0, 1]")
        if every < 1:
            raise ValueError(f"dynamics.every={every} must be >= 1")
        if start_step < 0 or anneal_steps < 0:
            raise ValueError(f"dynamics.start_step={start_step} and anneal_steps={anneal_steps} must be >= 0")
        self.capacity = capacity
        self.every = every
        self.start_capacity = start_capacity
        self.start_step = start_step
        self.anneal_steps = anneal_steps
        self.log_every_n_steps = max(1, log_every_n_steps)
        self._routing: bool | None = None

    def capacity_at(self, step: int) -> float:
        """Capacity after ``step`` optimizer steps."""
        if step < self.start_step:
            return self.start_capacity
        t = 1.0 if self.anneal_steps == 0 else min(1.0, (step - self.start_step) / self.anneal_steps)
        return self.start_capacity + t * (self.capacity - self.start_capacity)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        enable(
            pl_module,
            DepthRouter,
            "routers in its blocks (GPT(mod_every=2))",
            mod_every=self.every,
            mod_capacity=self.start_capacity,
        )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        capacity = self.capacity_at(trainer.global_step)
        for _, router in parts(pl_module, DepthRouter):
            set_host_value(router, "capacity", capacity)
        routing = capacity < 1.0
        if routing != self._routing:
            # Below capacity 1 the routers join the auxiliary loss, so the carried loss starts to need gradients
            # across stage boundaries: the pipeline must rebuild its stages.
            self._routing = routing
            layers_changed(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps:
            return
        local = {i: (r.routed, r.seen) for i, r in parts(pl_module, DepthRouter)}
        for _, router in parts(pl_module, DepthRouter):
            router.routed = router.seen = 0
        metrics = {f"dynamics/routed_frac_block{i}": r / s for i, (r, s) in sorted(gather(local, trainer).items()) if s}
        metrics["dynamics/capacity"] = self.capacity_at(trainer.global_step)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
