"""The pipeline model contract: what a LightningModule provides so that DynMo can split it into stages.

A module is *pipeline-ready* when it has

- ``pipeline_layers() -> Sequence[nn.Module]``: the ordered layers; layer ``i`` maps the output of layer ``i - 1``
  (a tensor or a tuple of tensors) to its own output. The first layer receives the batch inputs.
- ``pipeline_loss(output, target) -> Tensor``: the scalar loss of one micro-batch from the last layer's output.

The optional hooks (``pipeline_split_batch``, ``pipeline_eval_step``, ``pipeline_unused_parameters``,
``pipeline_init_layer``, ``pipeline_parallelize_layer``) are listed in :mod:`dynmo_lightning.protocol`.
:class:`PipelineModule` is a LightningModule base class that turns the contract into single-process ``forward``,
``training_step``, ``validation_step`` and ``test_step``, so one model class trains both with and without
``DynMoStrategy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor, nn

from dynmo_lightning.core.context import stage_forward
from dynmo_lightning.core.layer_calls import run_layers


class ProtocolError(TypeError):
    """The LightningModule does not implement the pipeline model protocol."""


def check_protocol(module: Any) -> list[nn.Module]:
    """Validate that ``module`` implements the pipeline protocol and return its layers.

    Args:
        module: the LightningModule given to the Trainer.

    Returns:
        The ordered list of pipeline layers.

    Raises:
        ProtocolError: a method is missing or ``pipeline_layers()`` returns something unusable.

    """
    name = type(module).__name__
    missing = [m for m in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, m, None))]
    if missing:
        raise ProtocolError(
            f"{name} cannot be split into pipeline stages: it has no {' and no '.join(f'`{m}()`' for m in missing)}. "
            "A pipeline-ready LightningModule defines `pipeline_layers()` (the ordered nn.Modules, each mapping the "
            "previous layer's output to its own) and `pipeline_loss(output, target)` (the loss of one micro-batch). "
            "See the README section 'Model protocol'."
        )
    layers = module.pipeline_layers()
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ProtocolError(f"{name}.pipeline_layers() must return a sequence of nn.Modules, got one {type(layers)}.")
    layers = list(layers)
    if not layers:
        raise ProtocolError(f"{name}.pipeline_layers() returned no layers.")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ProtocolError(f"{name}.pipeline_layers()[{i}] is a {type(layer).__name__}, not an nn.Module.")
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        if id(layer) in seen:
            raise ProtocolError(
                f"{name}.pipeline_layers() lists the same module at positions {seen[id(layer)]} and {i}; "
                "every layer must be a distinct module."
            )
        seen[id(layer)] = i
    return layers


def split_batch(module: Any, batch: Any) -> tuple[Any, Any]:
    """Split a dataloader batch into (inputs, target) with the module's hook or the default pair convention."""
    hook = getattr(module, "pipeline_split_batch", None)
    if callable(hook):
        return hook(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ProtocolError(
        f"{type(module).__name__}: a batch must be a pair (inputs, target), got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. "
        "Define `pipeline_split_batch(batch) -> (inputs, target)` on the module to say how to split it."
    )


def may_leave_parameters_unused(module: nn.Module) -> bool:
    """Whether a step may leave some trainable parameters of ``module`` without a gradient.

    A submodule says so with ``pipeline_unused_parameters() -> bool`` (an MoE layer running expert by expert); data
    parallelism then lets DDP find them each step, which costs a graph search and a read of the device.
    """
    return any(callable(hook := getattr(m, "pipeline_unused_parameters", None)) and hook() for m in module.modules())


def needs_whole_backward(module: nn.Module) -> bool:
    """Whether a split backward (zero-bubble and V schedules) must run ``module``'s backward whole.

    A submodule says so with ``pipeline_whole_backward() -> bool``: a parameter trained from a detached input (a
    Mixture-of-Depths predictor) lies on no path from the stage's inputs, so torch's input pass finds no
    intermediate for it and its weight pass computes no gradient for it.
    """
    return any(callable(hook := getattr(m, "pipeline_whole_backward", None)) and hook() for m in module.modules())


class PipelineModule(L.LightningModule):
    """LightningModule base for pipeline-ready models: implement ``pipeline_layers`` and ``pipeline_loss``.

    Provides ``forward`` (all layers in order) and single-process ``training_step`` / ``validation_step`` /
    ``test_step`` that log ``train_loss``, ``val_loss`` and ``val_ppl`` (``test_*``), the names ``DynMoStrategy``
    logs when it runs the same model as a pipeline. ``val_ppl`` (exp of the mean loss) is logged for token targets
    (integer targets with a sequence dimension). Evaluation steps then call ``pipeline_eval_step(output, target,
    stage)`` if the module defines it, as the strategy does on the last stage: one method logs a model's own metrics
    with and without the pipeline.
    """

    def pipeline_layers(self) -> Sequence[nn.Module]:
        """The ordered pipeline layers."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_layers()")

    def pipeline_loss(self, output: Any, target: Tensor) -> Tensor:
        """Loss of one (micro-)batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_loss(output, target)")

    def forward(self, inputs: Any) -> Any:
        """Run all layers in order."""
        with stage_forward():
            return run_layers(self.pipeline_layers(), inputs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Single-process step (a pipeline strategy runs its own schedule instead)."""
        inputs, target = split_batch(self, batch)
        loss = self.pipeline_loss(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, prefix: str, batch: Any) -> None:
        inputs, target = split_batch(self, batch)
        output = self(inputs)
        loss = self.pipeline_loss(output, target)
        self.log(f"{prefix}_loss", loss, prog_bar=True)
        if not target.is_floating_point() and target.dim() >= 2:  # token targets: perplexity means something
            self.log(f"{prefix}_ppl", torch.exp(loss))
        hook = getattr(self, "pipeline_eval_step", None)
        if callable(hook):
            hook(output, target, prefix)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Single-process validation step."""
        self._eval_step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Single-process test step."""
        self._eval_step("test", batch)
