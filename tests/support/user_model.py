"""A model as a user writes it: plain nn.Module layers built in __init__, its own training_step and DataLoader.

Not the reference GPT: residual MLP blocks on random regression data, made pipeline-ready by the two protocol methods.
Used by ``tests/test_user_model.py`` in-process (plain single-device Lightning) and by
``tests/support/_user_script.py`` in launched processes (``DynMoStrategy``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

WIDTH, N_SAMPLES, STEPS = 16, 512, 24


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class UserNet(L.LightningModule):
    def __init__(self, n_blocks: int = 6) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), *(Residual(WIDTH) for _ in range(n_blocks))])
        self.head = nn.Linear(WIDTH, 1)
        self.losses: list[float] = []

    # the pipeline protocol: the layers in order, and the loss of one micro-batch
    def pipeline_layers(self) -> list[nn.Module]:
        return [*self.blocks, self.head]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    # what the user wrote for single-device training
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


class UserTPNet(UserNet):
    """The same model with the user's own tensor-parallel plan: each residual block's MLP split over ``tp_mesh``."""

    def pipeline_parallelize_layer(self, index: int, layer: nn.Module, tp_mesh: Any) -> None:
        if isinstance(layer, Residual):  # the first linear layer and the head run whole
            parallelize_module(layer, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def loader(batch_size: int = 16, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_SAMPLES, WIDTH, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, drop_last=True)


def fit(
    strategy: Any = "auto",
    devices: int = 1,
    batch_size: int = 16,
    shuffle: bool = False,
    callbacks=(),
    tp: bool = False,
    *,
    model: UserNet | None = None,
    clip: float | None = 0.5,
    steps: int = STEPS,
) -> dict:
    """Train; returns the losses and (on global rank 0) the whole model's final state dict.

    ``tp``: the model with the user's tensor-parallel plan (:class:`UserTPNet`); ``model``: another model to train
    (``tp`` then unused); ``clip``: ``gradient_clip_val`` (``None``: no clipping); ``steps``: optimizer steps.
    """
    model = model if model is not None else UserTPNet() if tp else UserNet()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=clip,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader(batch_size, shuffle))
    return {"losses": model.losses, "trainer": trainer, "model": model}


def save(result: dict, path: Path) -> None:
    """Write losses and the gathered whole-model state dict (global rank 0 writes)."""
    trainer = result["trainer"]
    checkpoint = path.with_suffix(".ckpt")
    trainer.save_checkpoint(checkpoint)
    if trainer.is_global_zero:
        path.write_text(json.dumps({"losses": result["losses"]}))
