"""The strategy's precision plugin: the Trainer's own precision, with gradient clipping by the pipeline's global norm.

Lightning clips in ``LightningModule.clip_gradients`` through ``trainer.precision_plugin.clip_gradients``, which
clips the parameters it is given. Under a pipeline each process holds one stage's parameters, so clipping by norm
must use the norm over all stages. :class:`PipelinePrecision` wraps whatever precision plugin the Trainer chose
(``32-true``, ``bf16-mixed``, ``64-true``, ...) and delegates everything to it except ``clip_grad_by_norm``, which
calls :class:`~dynmo_lightning.pipeline.reduce.GlobalNormClipping`. Clipping by value is element-wise, the same on
every stage, and stays the plugin's own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override


class PipelinePrecision(Precision):
    """Delegates to ``inner``; clips by the global norm with ``clip_by_norm(optimizer, clip_val)`` once it is set.

    Args:
        inner: the Trainer's precision plugin.
    """

    def __init__(self, inner: Precision) -> None:
        super().__init__()
        self.inner = inner
        #: Set by the strategy once the model is split; until then clipping by norm is the plugin's own.
        self.clip_by_norm: Callable[[Optimizer, float], None] | None = None

    def __getattr__(self, name: str) -> Any:
        # Attributes of the wrapped plugin (`precision`, `scaler`, ...); only called for names not found here.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clip_by_norm is None:
            self.inner.clip_grad_by_norm(optimizer, clip_val)
        else:
            self.clip_by_norm(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.inner.clip_grad_by_value(optimizer, clip_val)

    # Everything else is the wrapped plugin's.
    @override
    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        return self.inner.connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: Module) -> Module:
        return self.inner.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return self.inner.pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:
        return self.inner.post_backward(tensor, module)

    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # The plugin's closure wrapper calls the LightningModule's clipping hook, which lands in `clip_gradients`
        # of the Trainer's precision plugin: this one.
        return self.inner.optimizer_step(optimizer, model, closure, **kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.inner.main_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.inner.unscale_gradients(optimizer)

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self.inner.train_step_context():
            yield

    @override
    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        with self.inner.val_step_context():
            yield

    @override
    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.inner.test_step_context():
            yield

    @override
    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.inner.predict_step_context():
            yield

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_save_checkpoint(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.inner.on_load_checkpoint(checkpoint)

    @override
    def teardown(self) -> None:
        self.inner.teardown()
