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
        #: Set by the strategy when it recovers without restart: runs a step's closure (forward, backward, hooks,
        #: clipping) until every process finished it, before the optimizer applies the step. ``None``: as is.
        self.run_closure: Callable[[Callable[[], Any]], Any] | None = None
        #: Set with ``run_closure``: applies a whole optimizer step (closure, commit, update) and what must follow it
        #: before the step counts (the copies of FSDP2's shards). ``None``: as is.
        self.run_step: Callable[[Callable[[], Any]], Any] | None = None

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
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.run_closure is not None:
            optimizer = _CommittedSteps(optimizer, self.run_closure, self.run_step)
        return self.inner.optimizer_step(optimizer, model, closure, **kwargs)


class _CommittedSteps:
    """An optimizer whose ``step`` runs its closure through ``run_closure`` before it applies the update.

    The closure is the plugin's wrapper: the clipping's communication belongs to the step.
    """

    def __init__(
        self,
        optimizer: Any,
        run_closure: Callable[[Callable[[], Any]], Any],
        run_step: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        self._optimizer, self._run_closure, self._run_step = optimizer, run_closure, run_step

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is None:
            return self._optimizer.step(**kwargs)
        apply = lambda: self._optimizer.step(closure=lambda: self._run_closure(closure), **kwargs)  # noqa: E731
        return apply() if self._run_step is None else self._run_step(apply)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


#: The hooks of Lightning's ``Precision`` that are the wrapped plugin's own, called with the same arguments. Not among
#: them: ``clip_grad_by_norm`` (above) and ``clip_gradients``, whose base implementation calls this class's clipping.
#: ``optimizer_step`` is, through a committing optimizer when the strategy recovers without restart: the plugin's
#: closure wrapper calls the LightningModule's clipping hook, which lands in ``clip_gradients`` of the Trainer's
#: precision plugin, this one.
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
