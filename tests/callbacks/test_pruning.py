"""GradualPruning: the cubic schedule, structured pruning that really shrinks compute, state that survives."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import GradualPruning
from dynmo_lightning.callbacks.pruning import cubic_sparsity
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.models.gpt import MLP, Block

pytestmark = pytest.mark.timeout(300)


def test_cubic_schedule():
    # s_t = s_f + (s_0 - s_f)(1 - (t - t0)/(n dt))^3
    assert cubic_sparsity(0, 0.0, 0.8, 10, 110) == 0.0
    assert cubic_sparsity(10, 0.0, 0.8, 10, 110) == 0.0
    assert cubic_sparsity(60, 0.0, 0.8, 10, 110) == pytest.approx(0.8 - 0.8 * 0.5**3)
    assert cubic_sparsity(110, 0.1, 0.8, 10, 110) == pytest.approx(0.8)
    assert cubic_sparsity(500, 0.1, 0.8, 10, 110) == pytest.approx(0.8)


def _flops(module: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x).sum().backward()
    return counter.get_total_flops()


def test_structured_pruning_shrinks_mlp_flops_and_keeps_optimizer_state():
    torch.manual_seed(0)
    mlp = MLP(64, 256, 0.0, True)
    opt = torch.optim.AdamW(mlp.parameters())
    mlp(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = _flops(mlp, torch.randn(8, 16, 64))
    keep = torch.arange(0, 256, 4)  # keep a quarter of the neurons
    moment = opt.state[mlp.fc.weight]["exp_avg"][keep].clone()
    weight_id = id(mlp.fc.weight)
    mlp.keep_units(keep, [opt])
    after = _flops(mlp, torch.randn(8, 16, 64))
    assert after / before == pytest.approx(0.25, rel=0.02)  # compute falls with the kept fraction
    assert mlp.fc.weight.shape == (64, 64) and mlp.proj.weight.shape == (64, 64)
    assert id(mlp.fc.weight) == weight_id  # same parameter object: optimizers and schedulers still see it
    assert torch.equal(opt.state[mlp.fc.weight]["exp_avg"], moment)  # sliced, not reset
    opt.step()  # the optimizer keeps working on the smaller shapes


def _trainer(max_steps, callbacks, **kw):
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


def test_global_structured_pruning_reaches_target_and_resumes_pruned(tmp_path):
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32)
    pruning = GradualPruning(final_sparsity=0.5, start_step=2, end_step=6, every_n_steps=2)
    trainer = _trainer(8, [pruning], default_root_dir=tmp_path)
    trainer.fit(model, datamodule=_data())
    blocks = [layer for layer in model.pipeline_layers() if isinstance(layer, Block)]
    neurons = sum(b.mlp.fc.weight.shape[0] for b in blocks)
    heads = sum(b.attn.n_head for b in blocks)
    assert neurons == 0.5 * 3 * 128 and heads == 6
    assert pruning.sparsity == 0.5
    path = tmp_path / "pruned.ckpt"
    trainer.save_checkpoint(path)

    fresh = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32)
    resumed = GradualPruning(final_sparsity=0.5, start_step=2, end_step=6, every_n_steps=2)
    trainer = _trainer(9, [resumed], default_root_dir=tmp_path)
    trainer.fit(fresh, datamodule=_data(), ckpt_path=path)  # the checkpoint's shapes win over the fresh model's
    for a, b in zip(model.pipeline_layers(), fresh.pipeline_layers(), strict=True):
        assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    assert sum(b.attn.n_head for b in fresh.pipeline_layers() if isinstance(b, Block)) == 6


def test_unstructured_pruning_masks_weights_and_keeps_them_zero():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)
    pruning = GradualPruning(final_sparsity=0.6, start_step=1, end_step=3, every_n_steps=1, mode="unstructured")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=[pruning],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=_data())  # plain Lightning, no pipeline strategy
    weights = [
        m.weight for layer in model.pipeline_layers()[:-1] for m in layer.modules() if isinstance(m, torch.nn.Linear)
    ]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(0.6, abs=0.01)  # and still zero three steps after the last pruning step


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"final_sparsity": 1.0}, r"final_sparsity=1.0 must be in \[0, 1\)"),
        ({"final_sparsity": -0.1}, r"final_sparsity=-0.1 must be in \[0, 1\)"),
        ({"start_step": 50, "end_step": 40}, "end_step=40 must come after dynamics.start_step=50"),
        ({"initial_sparsity": 0.6, "final_sparsity": 0.5}, r"initial_sparsity=0.6 must be in \[0, final_sparsity"),
        ({"mode": "random"}, "mode='random' is not one of"),
        ({"scope": "row"}, "scope='row' is not one of"),
        ({"multiple_of": 0}, "multiple_of=0 must be >= 1"),
    ],
)
def test_bad_pruning_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradualPruning(**kwargs)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_units_are_kept_in_multiples_of_the_tensor_parallel_size_with_the_next_best(scope):
    scores = {
        (0, "mlp"): ("neuron", 8, [8.0, 7, 6, 5, 4, 3, 2, 1]),
        (1, "mlp"): ("neuron", 8, [1.0, 2, 3, 9, 9, 9, 9, 9]),
    }
    pruning = GradualPruning(scope=scope, min_units=1)
    plain = pruning._units_to_keep(scores, 0.6)  # 40 % of 16 units: 7 (global), ceil(3.2) = 4 per module (layer)
    paired = pruning._units_to_keep(scores, 0.6, multiple=2)
    for key, kept in paired.items():
        assert len(kept) % 2 == 0
        assert set(plain[key].tolist()) <= set(kept.tolist())  # rounding up only adds units ...
        assert len(kept) - len(plain[key]) < 2  # ... fewer than the multiple
        best = sorted(range(8), key=lambda j: (-scores[key][2][j], j))[: len(kept)]
        assert kept.tolist() == sorted(best)  # ... and the next best ones
    if scope == "global":
        assert [len(k) for k in plain.values()] == [2, 5] and [len(k) for k in paired.values()] == [2, 6]
    # min_units rounds up too
    assert [len(k) for k in GradualPruning(scope=scope, min_units=3)._units_to_keep(scores, 0.99, 2).values()] == [4, 4]
