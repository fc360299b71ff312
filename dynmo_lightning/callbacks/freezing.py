"""LayerFreezing: progressively freeze a prefix of the pipeline layers, with a real compute saving.

Decided from training signals as in AutoFreeze / PipeTransformer (``mode="auto"``): each layer's gradient norm is
accumulated over a window of ``check_every_n_steps`` steps; at every check the relative change of that accumulated
norm from the previous window is compared across the still-trainable layers, and the prefix is frozen up to (not
including) the first layer whose change ratio reaches the ``percentile`` of them — layers in front that have stopped
moving are done learning. ``mode="schedule"`` freezes layer ``i`` at a fixed step instead (reproducible experiments).
The head (last layer) is never frozen; ``max_frozen_fraction`` caps the prefix.

Why the saving is real: a frozen layer's parameters get ``requires_grad=False`` and leave the optimizer (their state
is dropped) — except a parameter tied to a layer that keeps training (a token embedding tied to the head), which
keeps learning through that layer. The frozen prefix runs without autograd (:func:`~dynmo_lightning.protocol.
call_layer`: nothing before a frozen layer trains), so no activations are kept and there is no backward at all, also
with tied embeddings (the tied weight then learns through the head alone, as freezing the embedding means); a
pipeline stage made only of frozen layers runs forward only (its output carries no gradient, and the strategy
rebuilds the stages when the prefix grows). The frozen flag lives on the layer (``layer.pipeline_frozen``), so it
moves with the layer. A model with its own ``forward`` runs the frozen prefix without autograd only if it calls the
layers through :func:`~dynmo_lightning.protocol.run_layers` (``PipelineModule`` does); under ``DynMoStrategy`` the
pipeline always does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from typing_extensions import Self, override

from dynmo_lightning.core.callback_tools import all_gather, layers_changed, local_layers
from dynmo_lightning.core.control import LayerEvents, pipeline_control
from dynmo_lightning.optim import drop_params
from dynmo_lightning.settings import build, configured_by, from_settings

MODES = ("auto", "schedule")

#: Layer attribute holding the layer's gradient norms summed over the current window.
_WINDOW = "pipeline_freeze_window"


@dataclasses.dataclass(kw_only=True)
class FreezingSettings:
    """:class:`LayerFreezing`'s settings (Hydra: ``conf/dynamics/freezing.yaml``)."""

    mode: str = "auto"
    """``"auto"`` (from the gradient-norm change, AutoFreeze-style) or ``"schedule"``."""
    check_every_n_steps: int = 25
    """Window length and check interval of ``auto`` mode."""
    start_step: int = 50
    """No freezing before this step."""
    percentile: float = 50.0
    """In (0, 100]: ``auto`` freezes up to the first layer whose change ratio is at least this percentile of the
    trainable layers' ratios (lower freezes more cautiously)."""
    max_frozen_fraction: float = 0.75
    """At most this fraction of the layers is frozen (the head never is)."""
    schedule: dict[int, int] | None = None
    """``{layer index: step}`` for ``mode="schedule"``; steps must not decrease with the index (a prefix)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"dynamics.mode={self.mode!r} is not one of {list(MODES)}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"dynamics.percentile={self.percentile} must be in (0, 100]")
        if not 0.0 <= self.max_frozen_fraction < 1.0:
            raise ValueError(f"dynamics.max_frozen_fraction={self.max_frozen_fraction} must be in [0, 1)")
        if self.check_every_n_steps < 1:
            raise ValueError(f"dynamics.check_every_n_steps={self.check_every_n_steps} must be >= 1")
        if self.schedule is not None:  # a Hydra DictConfig, string keys: plain integers
            self.schedule = {int(k): int(v) for k, v in self.schedule.items()}
        schedule = self.schedule
        if self.mode == "schedule":
            if not schedule:
                raise ValueError("dynamics.mode='schedule' needs dynamics.schedule={layer index: step, ...}")
            steps = [int(schedule[i]) if i in schedule else None for i in range(max(map(int, schedule)) + 1)]
            if None in steps or any(b < a for a, b in itertools.pairwise(steps)):
                raise ValueError(
                    f"dynamics.schedule={dict(schedule)} must freeze a prefix: give layers 0..k, with steps that do "
                    "not decrease with the layer index"
                )


class LayerFreezing(Callback):
    """Freeze a growing prefix of ``pipeline_layers()`` during training.

    Set by :class:`FreezingSettings`: its fields as keyword arguments, or one settings object through
    :meth:`from_settings`.
    """

    @configured_by(FreezingSettings)
    def __init__(self, **kwargs: Any) -> None:
        self.settings = build(FreezingSettings, "LayerFreezing", "dynamics", kwargs)
        #: Number of frozen layers (layers ``0 .. frozen - 1``), the same on every process.
        self.frozen = 0
        self._previous: dict[int, float] | None = None
        self._restored_window: dict[int, float] = {}
        self._applied = 0
        self._module: pl.LightningModule | None = None

    @classmethod
    def from_settings(cls, settings: FreezingSettings, **overrides: Any) -> Self:
        """The callback of one settings object (``overrides`` replace some of its fields)."""
        return from_settings(cls, FreezingSettings, settings, overrides)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n_layers = len(pl_module.pipeline_layers())
        schedule = self.settings.schedule
        if schedule and max(schedule) >= n_layers - 1:
            raise ValueError(
                f"dynamics.schedule freezes layer {max(schedule)} but the model has {n_layers} layers and the "
                "last (the head) is never frozen"
            )
        self._applied = 0
        self._apply(trainer, pl_module)  # a resumed run re-freezes its prefix
        for i, layer in local_layers(pl_module):
            if i in self._restored_window:
                setattr(layer, _WINDOW, self._restored_window[i])
        self._restored_window = {}

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.settings.mode != "auto":
            return
        for _, layer in local_layers(pl_module):
            grads = [p.grad for p in layer.parameters() if p.grad is not None]
            if grads:
                # The running sum stays on the device (no read in the step); it is layer state, so it moves with the
                # layer when it migrates.
                setattr(layer, _WINDOW, getattr(layer, _WINDOW, 0.0) + _norm(grads))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step < self.settings.start_step:
            return
        n_layers = len(pl_module.pipeline_layers())
        limit = min(n_layers - 1, math.floor(self.settings.max_frozen_fraction * n_layers))
        if self.settings.mode == "schedule":
            target = sum(1 for i, t in self.settings.schedule.items() if t <= step)
        elif step % self.settings.check_every_n_steps == 0:
            target = self._decide(pl_module, n_layers)
        else:
            return
        target = min(target, limit)
        if target > self.frozen:
            self.frozen = target
            self._apply(trainer, pl_module)
            pl_module.log("freezing/frozen_layers", float(self.frozen), on_step=True, on_epoch=False)

    def _decide(self, pl_module: pl.LightningModule, n_layers: int) -> int:
        """The frozen prefix length after this window (collective: every process takes part)."""
        window = _gather_windows(pl_module)
        for _, layer in local_layers(pl_module):
            setattr(layer, _WINDOW, 0.0)
        previous, self._previous = self._previous, window
        if previous is None:
            return self.frozen
        candidates = [i for i in range(self.frozen, n_layers - 1) if i in window and previous.get(i, 0.0) > 0]
        if not candidates:
            return self.frozen
        ratios = {i: abs(window[i] - previous[i]) / previous[i] for i in candidates}
        threshold = float(np.percentile(list(ratios.values()), self.settings.percentile))
        k = self.frozen
        while k < n_layers - 1 and k in ratios and ratios[k] < threshold:
            k += 1
        return k

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Freeze local layers ``[applied, frozen)`` and tell the strategy (stage boundaries may lose gradients)."""
        if self.frozen == self._applied:
            return
        newly = []
        shared_with = _sharing(trainer, pl_module)
        for i, layer in local_layers(pl_module):
            if self._applied <= i < self.frozen:
                layer.pipeline_frozen = True
                for p in layer.parameters():
                    if any(j >= self.frozen for j in shared_with(p)):
                        continue  # tied with a layer that keeps training (an embedding tied to the head)
                    p.requires_grad_(False)
                    p.grad = None
                    newly.append(p)
        drop_params(newly, trainer.optimizers)
        changed = range(self._applied, self.frozen)
        self._applied = self.frozen
        layers_changed(trainer, changed)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # Every process calls this when a checkpoint is written; the windows live on the layers of all stages.
        window = _gather_windows(self._module) if self._module is not None else {}
        return {"frozen": self.frozen, "window": window, "previous": self._previous}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._module = pl_module

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.frozen = int(state_dict["frozen"])
        self._restored_window = {int(k): float(v) for k, v in state_dict.get("window", {}).items()}
        previous = state_dict.get("previous")
        self._previous = {int(k): float(v) for k, v in previous.items()} if previous is not None else None


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` together, in float64 (exact for every floating dtype, so any mix stacks safely).

    Gradients held in parts (DTensors: FSDP2 shards, tensor-parallel splits) count by their whole value: their norms
    are reduced over the processes holding the parts (every one of them runs this for the same layer), and mix
    with the norms of whole gradients (a split layer's norms, say) as plain tensors.
    """
    parts = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    norms = [n.full_tensor() for n in torch._foreach_norm(parts)] if parts else []
    norms += list(torch._foreach_norm(whole)) if whole else []
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float64) for n in norms]))


def _gather_windows(pl_module: pl.LightningModule) -> dict[int, float]:
    """Every layer's window sum, from all processes (layers that never had a gradient are absent).

    The only read of the device: once per check (and checkpoint), every local layer's sum in one float64 read.
    """
    found = {i: getattr(layer, _WINDOW) for i, layer in local_layers(pl_module) if hasattr(layer, _WINDOW)}
    tensors = [v for v in found.values() if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    local = {i: next(read) if isinstance(v, torch.Tensor) else float(v) for i, v in found.items()}
    return {i: v for part in all_gather(local, pl_module.trainer) for i, v in part.items()}


def _sharing(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """``param -> indices of the layers sharing it``: from a pipeline strategy (which sees all stages), or locally."""
    control = pipeline_control(trainer, LayerEvents)
    if control is not None:
        return control.tie_layers
    owners: dict[int, set[int]] = {}
    for i, layer in local_layers(pl_module):
        for p in layer.parameters():
            owners.setdefault(id(p), set()).add(i)
    return lambda p: owners.get(id(p), set())
