"""TokenEarlyExit: tokens stop being processed once their representation saturates, saving real compute.

Switches on the reference GPT's exit gates (``GPT(early_exit=True)``; see :mod:`dynmo_lightning.models.routing` for
how blocks then compute only on active tokens) and schedules the saturation threshold λ: no exits before
``warmup_steps``, then λ ramps linearly from 1 (nothing exits) down to ``threshold`` over ``ramp_steps``. A token may
exit after block ``b`` (1-based) when ``b >= min_layers`` and ``b % exit_every == 0``. Later layers, and so later
pipeline stages, get cheaper as training goes on: what the balancer then evens out.

Logged every ``log_every_n_steps``: ``early_exit/layer{b}/exit_frac`` (share of all tokens that exited after block b
since the last log) and ``early_exit/active_frac`` (share still active after the last block).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import lightning.pytorch as pl
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import RoutedDynamics, RoutedSettings, check_at_least, check_fractions
from dynmo_lightning.core.host_values import read_once, set_host_value
from dynmo_lightning.models.routing import EXIT_SYNC, ExitGate
from dynmo_lightning.settings import configured_by


@dataclasses.dataclass(kw_only=True)
class EarlyExitSettings(RoutedSettings):
    """:class:`TokenEarlyExit`'s settings (Hydra: ``conf/dynamics/early_exit.yaml``)."""

    threshold: float = 0.9
    """λ in (0, 1]: a token exits after a block when cos(state in, state out) >= λ. Lower exits more tokens
    earlier: later blocks (and stages) get cheaper, and the model learns from fewer of its layers per token."""
    warmup_steps: int = 50
    """Steps without exits (the representations must first mean something)."""
    ramp_steps: int = 50
    """Steps over which λ falls from 1 (nothing exits) to ``threshold``, linearly; 0: ``threshold`` at once after
    the warm-up. The balancer sees the cost drift along the ramp."""
    min_layers: int = 1
    """Blocks every token passes before it may exit."""
    exit_every: int = 1
    """Exits only after every ``exit_every``-th block (block ``b``, 1-based, with ``b % exit_every == 0``); fewer
    exit points, fewer gates."""
    sync: str = "auto"
    """How often blocks read the number of active tokens from the device: ``"stage"`` once per stage and
    micro-batch (bucketed), ``"layer"`` once per block (exact), ``"auto"`` (``"stage"`` on accelerators, ``"layer"``
    on CPU, where a read does not stall a device stream)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fractions(threshold=self.threshold)
        check_at_least(0, warmup_steps=self.warmup_steps, ramp_steps=self.ramp_steps)
        check_at_least(1, min_layers=self.min_layers, exit_every=self.exit_every)
        if self.sync not in EXIT_SYNC:
            raise ValueError(f"dynamics.sync={self.sync!r} must be 'auto', 'stage' or 'layer'")


class TokenEarlyExit(RoutedDynamics, name="early_exit", part=ExitGate, settings=EarlyExitSettings):
    """Token early exit by hidden-state saturation; set by :class:`EarlyExitSettings` (its fields, or one object)."""

    settings: EarlyExitSettings
    fixed_options: ClassVar[dict[str, Any]] = {"early_exit": True}

    @configured_by(EarlyExitSettings)
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def threshold_at(self, step: int) -> float:
        """λ after ``step`` optimizer steps (above 1: exits off)."""
        s = self.settings
        if step < s.warmup_steps:
            return 2.0
        if s.ramp_steps == 0:
            return s.threshold
        t = min(1.0, (step - s.warmup_steps) / s.ramp_steps)
        return 1.0 - t * (1.0 - s.threshold)

    @override
    def before_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        threshold = self.threshold_at(step)
        for i, gate in self.parts(pl_module):
            block = i  # pipeline layer i is block i (the embedding is layer 0)
            gate.may_exit = block >= self.settings.min_layers and block % self.settings.exit_every == 0
            gate.sync = self.settings.sync
            set_host_value(gate, "threshold", threshold)

    @override
    def layer_stats(self, local: list[tuple[int, ExitGate]]) -> dict[int, tuple[float, float]]:
        counts = read_once([c for _, gate in local for c in (gate.exited, gate.processed)])  # one read for all
        for _, gate in local:
            gate.exited = gate.processed = 0
        return {i: (counts[2 * n], counts[2 * n + 1]) for n, (i, _) in enumerate(local)}

    @override
    def layer_metrics(self, stats: dict[int, tuple[float, float]]) -> dict[int, dict[str, float]]:
        tokens = _tokens(stats)
        return {i: {"exit_frac": e / tokens} for i, (e, _) in stats.items()} if tokens else {}

    @override
    def model_metrics(self, stats: dict[int, tuple[float, float]], step: int) -> dict[str, float]:
        tokens = _tokens(stats)
        return {"active_frac": 1.0 - sum(e for e, _ in stats.values()) / tokens} if tokens else {}


def _tokens(stats: dict[int, tuple[float, float]]) -> float:
    """Tokens seen since the last log: every token is active at the first gate."""
    return max((p for _, p in stats.values()), default=0)
