"""Stock Lightning machinery keeps working under DynMoStrategy: hooks, clipping, LR schedulers, callbacks, loggers."""

from __future__ import annotations

import csv

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

pytestmark = pytest.mark.timeout(300)


class RecordingGPT(GPT):
    """Records gradients as Lightning's hooks see them."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.after_backward_norms: list[float] = []
        self.before_step_norms: list[float] = []
        self.clipped_norms: list[float] = []

    def _norm(self) -> float:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def on_after_backward(self) -> None:
        self.after_backward_norms.append(self._norm())

    def on_before_optimizer_step(self, optimizer) -> None:
        self.before_step_norms.append(self._norm())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clipped_norms.append(self._norm())


def _data() -> StdlibCharDataModule:
    return StdlibCharDataModule(block_size=32, batch_size=16, max_bytes=200_000, max_val_batches=2)


def test_hooks_clipping_and_lr_schedule_see_the_pipeline_gradients(tmp_path):
    model = RecordingGPT(n_layer=2, n_embd=32, n_head=4, block_size=32, warmup_steps=4, lr_decay_steps=10)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=2),
        max_steps=6,
        gradient_clip_val=0.25,
        logger=CSVLogger(tmp_path, name="", version="csv"),
        callbacks=[LearningRateMonitor(logging_interval="step")],
        log_every_n_steps=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=_data())
    assert len(model.after_backward_norms) == len(model.before_step_norms) == len(model.clipped_norms) == 6
    # the schedule's gradients reach on_after_backward and on_before_optimizer_step (not wiped by zero_grad)
    assert all(n > 0 for n in model.after_backward_norms)
    assert model.before_step_norms == model.after_backward_norms
    # clipping acted on them: large norms were cut to the clip value
    assert max(model.before_step_norms) > 0.25
    assert all(n <= 0.25 * (1 + 1e-4) for n in model.clipped_norms)
    # the warm-up LR schedule stepped every optimizer step, and LearningRateMonitor logged it
    with open(tmp_path / "csv" / "metrics.csv") as f:
        lrs = [float(r["lr-AdamW/pg1"]) for r in csv.DictReader(f) if r.get("lr-AdamW/pg1")]
    assert lrs[:4] == pytest.approx([model.hparams.lr * (i + 1) / 4 for i in range(4)])


def test_early_stopping_and_tensorboard(tmp_path):
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)
    stop = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=0, mode="min")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=2),
        max_steps=50,
        val_check_interval=2,
        limit_val_batches=2,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[stop],
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=_data())
    assert trainer.global_step < 50 and stop.stopped_epoch is not None
    assert {"val_loss", "val_ppl", "train_loss"} <= set(trainer.callback_metrics)
    assert float(trainer.callback_metrics["val_ppl"]) == pytest.approx(
        float(torch.exp(trainer.callback_metrics["val_loss"])), rel=1e-4
    )
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_validate_and_predict_after_fit():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)
    data = _data()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=2),
        max_steps=2,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    (metrics,) = trainer.validate(model, datamodule=data)
    assert metrics["val_loss"] > 0
    x, y = next(iter(data.val_dataloader()))
    (logits,) = trainer.predict(model, DataLoader(TensorDataset(x, y), batch_size=16))
    assert logits.shape == (16, 32, 256)
