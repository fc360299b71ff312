"""A classifier as a user writes it: residual MLP blocks, a ``Linear(32, 4)`` head, ``cross_entropy`` on integer
labels, its own validation and test steps with torchmetrics ``Accuracy``, and its own ``DataLoader``s.

Its ``validation_step``/``test_step`` (plain Lightning) and the strategy call the same ``pipeline_eval_step``.
Used by ``tests/test_evaluation.py`` in-process (plain single-device Lightning, and the strategy at P = 1) and by
``tests/support/_classifier_script.py`` in launched processes (P = 2, 4).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

WIDTH, CLASSES, STEPS = 32, 4, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(WIDTH, CLASSES)
        self.val_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.test_acc = MulticlassAccuracy(CLASSES, average="micro")

    def pipeline_layers(self) -> list[nn.Module]:
        return [*self.blocks, self.head]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def pipeline_eval_step(self, output: torch.Tensor, target: torch.Tensor, stage: str) -> None:
        metric = self.val_acc if stage == "val" else self.test_acc
        metric.update(output.argmax(-1), target)
        self.log(f"{stage}_acc", metric, on_epoch=True)
        # A plain tensor too: the mean confidence of the batch, averaged over the epoch.
        self.log(f"{stage}_confidence", output.softmax(-1).amax(-1).mean(), on_epoch=True, batch_size=len(target))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        output = self(x)
        self.log(f"{stage}_loss", self.pipeline_loss(output, y), batch_size=len(y))
        self.pipeline_eval_step(output, y, stage)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader(split: str, n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed({"train": 1, "val": 2, "test": 3}[split])
    x = torch.randn(n, WIDTH, generator=g)
    y = (x[:, :2] > 0).long() @ torch.tensor([1, 2])  # four classes from two signs
    return DataLoader(TensorDataset(x, y), batch_size=16)


def run(strategy: Any = "auto", devices: int = 1) -> dict[str, float]:
    """Train, validate and test; the metrics every process ended with."""
    model = Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, check_val_every_n_epoch=1)  # fmt: skip
    trainer.fit(model, loader("train", 16 * STEPS), loader("val"))
    metrics = {f"fit/{k}": float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    for results in (trainer.validate(model, loader("val"), verbose=False), trainer.test(model, loader("test"),
                    verbose=False)):  # fmt: skip
        metrics |= {k: float(v) for k, v in results[0].items()}
    return metrics
