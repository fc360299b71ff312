"""Token early exit and Mixture of Depths: exact when nothing is skipped, cheaper as tokens skip, trainable."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dynmo_lightning.callbacks import MixtureOfDepths, TokenEarlyExit
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.models.gpt import Block

pytestmark = pytest.mark.timeout(300)


def _gpt(**kw) -> GPT:
    model = GPT(n_layer=4, n_embd=32, n_head=4, block_size=64, **kw)
    model.configure_model()
    return model


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("options", [{"early_exit": True}, {"mod_every": 2, "mod_capacity": 1.0}])
def test_enabled_but_nothing_skipped_is_exactly_dense(options):
    dense, dynamic = _gpt(), _gpt(**options)
    x = torch.randint(0, 256, (3, 64))
    logits, aux = dynamic(x)
    assert torch.equal(logits, dense(x))
    assert torch.equal(aux, torch.zeros(3))


def test_block_cost_falls_with_the_active_fraction():
    torch.manual_seed(0)
    block = Block(64, 4, 256, 0.0, True, early_exit=True)
    h = torch.randn(4, 128, 64)
    everyone = torch.ones(4, 128)
    quarter = (torch.rand(4, 128) < 0.25).float()
    quarter[:, :32] = 1.0  # a quarter or so of every sequence, at least its first 32 tokens
    quarter[:, 32:] *= 0
    aux = torch.zeros(4)
    full = _flops(lambda: block(h, everyone, aux))
    part = _flops(lambda: block(h, quarter, aux))
    assert part < 0.5 * full  # queries, attention and MLP shrink to the active tokens; keys/values stay
    nobody = _flops(lambda: block(h, torch.zeros(4, 128), aux))
    assert nobody == 0
    # exited tokens pass through unchanged, active ones are updated
    y, _, _ = block(h, quarter, aux)
    assert torch.equal(y[:, 32:], h[:, 32:]) and not torch.equal(y[:, :32], h[:, :32])


def test_mixture_of_depths_cost_falls_with_capacity_and_router_learns():
    torch.manual_seed(0)
    block = Block(64, 4, 256, 0.0, True, mod_capacity=1.0)
    h = torch.randn(4, 128, 64, requires_grad=True)
    state = (h, torch.ones(4, 128), torch.zeros(4))
    full = _flops(lambda: block(*state))
    block.depth_router.capacity.fill_(0.25)
    quarter = _flops(lambda: block(*state))
    assert quarter < 0.35 * full
    y, _, aux = block(*state)
    skipped = (y == h).all(-1).sum(1)
    assert (skipped == 128 - 32).all()  # exactly k = 32 tokens per sequence went through the block
    (y.sum() + aux.sum()).backward()
    assert block.depth_router.router.weight.grad.abs().sum() > 0  # the router weight gets a gradient
    assert block.depth_router.predictor.weight.grad.abs().sum() > 0  # and so does the causal predictor


def _fit(callback, steps: int = 60):
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32, lr=3e-3)
    data = StdlibCharDataModule(block_size=32, batch_size=16, max_bytes=200_000, max_val_batches=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        val_check_interval=steps,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
    )
    trainer.fit(model, datamodule=data)
    return trainer, model


def test_training_with_exits_lowers_validation_loss():
    callback = TokenEarlyExit(threshold=0.6, warmup_steps=10, ramp_steps=10, log_every_n_steps=5)
    trainer, model = _fit(callback)
    assert float(trainer.callback_metrics["val_loss"]) < 3.5  # from ln(256) = 5.5
    assert float(trainer.callback_metrics["early_exit/active_frac"]) < 1.0  # tokens did exit
    assert all(float(b.exit_gate.threshold) == pytest.approx(0.6) for b in model.blocks)


def test_training_with_mixture_of_depths_lowers_validation_loss():
    callback = MixtureOfDepths(capacity=0.25, every=2, start_step=5, anneal_steps=20, log_every_n_steps=5)
    trainer, model = _fit(callback)
    assert float(trainer.callback_metrics["val_loss"]) < 3.5
    assert float(model.blocks[1].depth_router.capacity) == pytest.approx(0.25)
    assert model.blocks[0].depth_router is None  # every second block is routed


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TokenEarlyExit(threshold=0.0), r"threshold=0.0 must be in \(0, 1\]"),
        (lambda: TokenEarlyExit(threshold=1.5), r"threshold=1.5 must be in \(0, 1\]"),
        (lambda: TokenEarlyExit(min_layers=0), "min_layers=0"),
        (lambda: MixtureOfDepths(capacity=0.0), r"capacity=0.0 must be in \(0, 1\]"),
        (lambda: MixtureOfDepths(capacity=1.2), r"capacity=1.2 must be in \(0, 1\]"),
        (lambda: MixtureOfDepths(every=0), "every=0 must be >= 1"),
        (lambda: GPT(mod_capacity=0.0), r"model.mod_capacity=0.0 must be in \(0, 1\]"),
    ],
)
def test_bad_routing_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dynamic_structure_cannot_change_after_the_layers_exist():
    model = _gpt()
    with pytest.raises(RuntimeError, match="already built"):
        model.configure_dynamics(early_exit=True)
