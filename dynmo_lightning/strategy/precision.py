"""The strategy's precision plugin: the Trainer's own precision, with gradient clipping by the pipeline's global norm.

Lightning clips in ``LightningModule.clip_gradients`` through ``trainer.precision_plugin.clip_gradients``, which
clips the parameters it is given. Under a pipeline each process holds one stage's parameters, so clipping by norm
must use the norm over all stages. :class:`PipelinePrecision` wraps whatever precision plugin the Trainer chose
(``32-true``, ``bf16-mixed``, ``64-true``, ...) and delegates everything to it except ``clip_grad_by_norm``, which
calls :class:`~dynmo_lightning.pipeline.stage.reduce.GlobalNormClipping`. Clipping by value is element-wise, the same on
every stage, and stays the plugin's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
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


#: The hooks of Lightning's ``Precision`` that are the wrapped plugin's own, called with the same arguments. Not among
#: them: ``clip_grad_by_norm`` (above) and ``clip_gradients``, whose base implementation calls this class's clipping.
#: ``optimizer_step`` is: the plugin's closure wrapper calls the LightningModule's clipping hook, which lands in
#: ``clip_gradients`` of the Trainer's precision plugin, this one.
DELEGATED = (
    "clip_grad_by_value",
    "connect",
    "convert_module",
    "tensor_init_context",
    "module_init_context",
    "forward_context",
    "convert_input",
    "convert_output",
    "pre_backward",
    "backward",
    "post_backward",
    "optimizer_step",
    "main_params",
    "unscale_gradients",
    "train_step_context",
    "val_step_context",
    "test_step_context",
    "predict_step_context",
    "state_dict",
    "load_state_dict",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "teardown",
)


def _delegate(name: str) -> Callable[..., Any]:
    def hook(self: PipelinePrecision, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    hook.__name__, hook.__qualname__ = name, f"PipelinePrecision.{name}"
    hook.__doc__ = f"The wrapped plugin's ``{name}``."
    return hook


for _name in DELEGATED:
    setattr(PipelinePrecision, _name, _delegate(_name))
