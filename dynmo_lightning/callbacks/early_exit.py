"""TokenEarlyExit: tokens stop being processed once their representation saturates, saving real compute.

Switches on the reference GPT's exit gates (``GPT(early_exit=True)``; see :mod:`dynmo_lightning.models.routing` for
how blocks then compute only on active tokens) and schedules the saturation threshold λ: no exits before
``warmup_steps``, then λ ramps linearly from 1 (nothing exits) down to ``threshold`` over ``ramp_steps``. A token may
exit after block ``b`` (1-based) when ``b >= min_layers`` and ``b % exit_every == 0``. Later layers, and so later
pipeline stages, get cheaper as training goes on: what the balancer then evens out.

Logged every ``log_every_n_steps``: ``dynamics/exit_frac_block{b}`` (share of all tokens that exited after block b
since the last log) and ``dynamics/active_frac`` (share still active after the last block).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.callbacks._dynamics import enable, gather, parts
from dynmo_lightning.models.routing import EXIT_SYNC, ExitGate
from dynmo_lightning.protocol import read_once, set_host_value


class TokenEarlyExit(Callback):
    """Token early exit by hidden-state saturation.

    Args:
        threshold: λ in (0, 1]: a token exits after a block when cos(state in, state out) >= λ.
        warmup_steps: steps without exits (the representations must first mean something).
        ramp_steps: steps over which λ falls from 1 to ``threshold`` (0: at once).
        min_layers: blocks every token passes before it may exit.
        exit_every: exits only after every ``exit_every``-th block.
        log_every_n_steps: interval of the exit histogram.
        sync: how often blocks read the number of active tokens from the device: ``"stage"`` once per stage and
            micro-batch (bucketed), ``"layer"`` once per block (exact), ``"auto"`` (``"stage"`` on accelerators,
            ``"layer"`` on CPU, where a read does not stall a device stream).
    """

    def __init__(
        self,
        threshold: float = 0.9,
        warmup_steps: int = 50,
        ramp_steps: int = 50,
        min_layers: int = 1,
        exit_every: int = 1,
        log_every_n_steps: int = 10,
        sync: str = "auto",
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"dynamics.threshold={threshold} must be in (0, 1]")
        if warmup_steps < 0 or ramp_steps < 0:
            raise ValueError(f"dynamics.warmup_steps={warmup_steps} and ramp_steps={ramp_steps} must be >= 0")
        if min_layers < 1 or exit_every < 1:
            raise ValueError(f"dynamics.min_layers={min_layers} and dynamics.exit_every={exit_every} must be >= 1")
        self.threshold = threshold
        self.warmup_steps = warmup_steps
        self.ramp_steps = ramp_steps
        self.min_layers = min_layers
        self.exit_every = exit_every
        self.log_every_n_steps = max(1, log_every_n_steps)
        if sync not in EXIT_SYNC:
            raise ValueError(f"dynamics.sync={sync!r} must be 'auto', 'stage' or 'layer'")
        self.sync = sync

    def threshold_at(self, step: int) -> float:
        """λ after ``step`` optimizer steps (above 1: exits off)."""
        if step < self.warmup_steps:
            return 2.0
        if self.ramp_steps == 0:
            return self.threshold
        t = min(1.0, (step - self.warmup_steps) / self.ramp_steps)
        return 1.0 - t * (1.0 - self.threshold)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        enable(pl_module, ExitGate, "exit gates in its blocks (GPT(early_exit=True))", early_exit=True)

    def _gates(self, pl_module: pl.LightningModule) -> list[tuple[int, ExitGate]]:
        return parts(pl_module, ExitGate)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        threshold = self.threshold_at(trainer.global_step)
        for i, gate in self._gates(pl_module):
            block = i  # pipeline layer i is block i (the embedding is layer 0)
            gate.may_exit = block >= self.min_layers and block % self.exit_every == 0
            gate.sync = self.sync
            set_host_value(gate, "threshold", threshold)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps:
            return
        gates = self._gates(pl_module)
        counts_ = read_once([c for _, gate in gates for c in (gate.exited, gate.processed)])
        local = {i: (counts_[2 * n], counts_[2 * n + 1]) for n, (i, _) in enumerate(gates)}
        for _, gate in gates:
            gate.exited = gate.processed = 0
        counts = gather(local, trainer)
        tokens = max((p for _, p in counts.values()), default=0)  # every token is active at the first gate
        if not tokens:
            return
        metrics = {f"dynamics/exit_frac_block{i}": e / tokens for i, (e, _) in sorted(counts.items())}
        metrics["dynamics/active_frac"] = 1.0 - sum(e for e, _ in counts.values()) / tokens
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
