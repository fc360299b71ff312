"""The user's model (``support.user_model``) trained with plain SGD: runs whose losses see the gradients' scale.

AdamW and clipping by norm are invariant to a uniform gradient scale (doubling every gradient moves AdamW's losses
by ~1e-7): an exactness run with them cannot tell a sum over replicas from a mean. SGD without momentum steps by the
gradient itself; at :data:`LR` a 2x gradient scale moves the losses of :data:`STEPS` steps by ~20 % relative (a
0.5x scale too). Used in-process for plain single-device Lightning (the reference) and by
``tests/support/_sgd_script.py`` in launched processes (``DynMoStrategy``); ``tests/pipeline/test_gradient_scale.py``
compares them.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from support.user_model import UserNet, UserTPNet, fit

#: Stable for this model at the gradient's scale and at twice it; large enough that either scale shows.
LR = 0.02
STEPS = 10
#: Below every pre-clip norm of the first :data:`STEPS` steps (about 1.8 to 5): clipping acts at every step.
CLIP = 1.0


class SGDNet(UserNet):
    """The user's model with plain SGD (no momentum, no weight decay)."""

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


class SGDTPNet(SGDNet, UserTPNet):
    """:class:`SGDNet` with the user's own tensor-parallel plan (``UserTPNet.pipeline_parallelize_layer``)."""


class PreClipNorms(Callback):
    """The global gradient norm before clipping, every optimizer step, as ``torch.nn.utils.clip_grad_norm_`` returns.

    Lightning calls ``on_before_optimizer_step`` after the backward and before it clips (one device: the whole model's
    gradients are here).
    """

    def __init__(self) -> None:
        self.norms: list[float] = []

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def train(
    strategy: Any = "auto",
    devices: int = 1,
    batch_size: int = 16,
    clip: float | None = None,
    tp: bool = False,
    callbacks: list[Callback] | None = None,
) -> SGDNet:
    """Train :class:`SGDNet` (or :class:`SGDTPNet`) for :data:`STEPS` steps on the user's loader; returns the model.

    Args:
        strategy: Lightning's strategy (``"auto"``: plain single-device Lightning).
        devices: processes.
        batch_size: the loader's batch size (per replica under data parallelism).
        clip: ``gradient_clip_val`` (by norm), ``None``: no clipping.
        tp: the model with the user's tensor-parallel plan.
        callbacks: more callbacks.
    """
    model = SGDTPNet() if tp else SGDNet()
    fit(strategy, devices, batch_size, callbacks=callbacks or [], model=model, clip=clip, steps=STEPS)
    return model
