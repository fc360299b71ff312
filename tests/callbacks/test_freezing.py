"""LayerFreezing: a frozen prefix trains no more and costs only its forward; state survives checkpoints."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import LayerFreezing
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

pytestmark = pytest.mark.timeout(300)


class ProfileLast(L.Callback):
    """Profiles the last step of a run."""

    def __init__(self, step: int) -> None:
        self.step, self.costs = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.pipeline_control.request_profile()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 == self.step:
            self.costs = trainer.strategy.pipeline_control.profile_results()


def _trainer(max_steps: int, callbacks: list, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=2),
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        **kw,
    )


def _data() -> StdlibCharDataModule:
    return StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000)


def test_frozen_prefix_leaves_optimizer_and_costs_only_its_forward(tmp_path):
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32, tie_embeddings=False)
    freezing = LayerFreezing(mode="schedule", schedule={0: 2, 1: 2, 2: 3}, start_step=0)
    profile = ProfileLast(5)
    trainer = _trainer(6, [freezing, profile], enable_checkpointing=False)
    trainer.fit(model, datamodule=_data())
    layers = model.pipeline_layers()
    assert freezing.frozen == 3
    for layer in layers[:3]:
        assert layer.pipeline_frozen and not any(p.requires_grad for p in layer.parameters())
    assert all(p.requires_grad for layer in layers[3:] for p in layer.parameters())
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not any(id(p) in optimized for layer in layers[:3] for p in layer.parameters())
    assert not any(p in trainer.optimizers[0].state for layer in layers[:3] for p in layer.parameters())
    # the frozen prefix runs forward only: no backward, no saved activations; trainable layers still have both
    for i in range(3):
        assert profile.costs[i]["bwd"] == 0.0 and profile.costs[i]["activation_bytes"] == 0
        assert profile.costs[i]["fwd"] > 0
    for i in (3, 4):
        assert profile.costs[i]["bwd"] > 0 and profile.costs[i]["activation_bytes"] > 0


def test_a_frozen_embedding_tied_to_the_head_keeps_learning_through_the_head_alone():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)  # tied embeddings
    freezing = LayerFreezing(mode="schedule", schedule={0: 1, 1: 1}, start_step=0)
    profile = ProfileLast(3)
    trainer = _trainer(4, [freezing, profile], enable_checkpointing=False)
    before = model.head.lm_head.weight.detach().clone() if model.blocks is not None else None
    trainer.fit(model, datamodule=_data())
    embed = model.pipeline_layers()[0]
    assert embed.pipeline_frozen and not embed.wpe.weight.requires_grad
    assert embed.wte.weight.requires_grad and embed.wte.weight is model.head.lm_head.weight
    assert before is None or not torch.equal(before, model.head.lm_head.weight)
    # The frozen prefix runs without autograd although its embedding weight trains (through the head): no backward
    # and no saved activations there, as with untied embeddings.
    for i in (0, 1):
        assert profile.costs[i]["bwd"] == 0.0 and profile.costs[i]["activation_bytes"] == 0
    assert profile.costs[2]["bwd"] > 0


def test_auto_freezing_state_survives_checkpoint(tmp_path):
    model = GPT(n_layer=4, n_embd=32, n_head=4, block_size=32, tie_embeddings=False)
    freezing = LayerFreezing(check_every_n_steps=5, start_step=5, percentile=90.0)
    trainer = _trainer(30, [freezing], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=_data())
    assert freezing.frozen >= 1  # it acted
    path = tmp_path / "frozen.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"]["LayerFreezing"]
    assert state["frozen"] == freezing.frozen and state["previous"]

    resumed_freezing = LayerFreezing(check_every_n_steps=5, start_step=5, percentile=90.0)
    fresh = GPT(n_layer=4, n_embd=32, n_head=4, block_size=32, tie_embeddings=False)
    trainer = _trainer(31, [resumed_freezing], default_root_dir=tmp_path)
    trainer.fit(fresh, datamodule=_data(), ckpt_path=path)
    assert resumed_freezing.frozen >= freezing.frozen
    for layer in fresh.pipeline_layers()[: freezing.frozen]:
        assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"percentile": 0.0}, r"percentile=0.0 must be in \(0, 100\]"),
        ({"percentile": 101.0}, r"percentile=101.0 must be in \(0, 100\]"),
        ({"mode": "magic"}, "mode='magic' is not one of"),
        ({"max_frozen_fraction": 1.0}, r"max_frozen_fraction=1.0 must be in \[0, 1\)"),
        ({"mode": "schedule"}, "needs dynamics.schedule"),
        ({"mode": "schedule", "schedule": {0: 10, 1: 5}}, "must freeze a prefix"),
        ({"mode": "schedule", "schedule": {0: 1, 2: 5}}, "must freeze a prefix"),
    ],
)
def test_bad_freezing_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerFreezing(**kwargs)


def test_freezing_works_without_dynmo_strategy():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32, tie_embeddings=False)
    freezing = LayerFreezing(mode="schedule", schedule={0: 1}, start_step=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[freezing],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=_data())
    assert not any(p.requires_grad for p in model.pipeline_layers()[0].parameters())
