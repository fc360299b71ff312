"""Invariant 1 — pipeline training equals single-process training with the same micro-batching — and checkpoints
that hold the unsplit model: written at P=2, they resume at P=1 and P=4 and load into the plain model.

20 AdamW steps of a tiny GPT with gradient clipping (so the global-norm clipping across stages is covered too).
All runs of one world size share one launch of processes (see tests/support/_worker.py).
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import assert_close_losses, assert_close_params, launch

from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = ["trainer.max_steps=20"]
# One epoch = 10 steps and a checkpoint after every 10th step: the resumed run starts the next epoch exactly where
# the uninterrupted run does (Lightning does not fast-forward a plain DataLoader inside an epoch).
EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("exact")
    out = launch(
        2,
        {
            d / "p2-gpipe": [*STEPS, "strategy.schedule=gpipe"],
            d / "p2-1f1b": [*STEPS, "strategy.schedule=1f1b"],
            d / "p2-explicit": [*STEPS, "strategy.partition=[2,4]"],
            d / "p2-params": [*STEPS, "strategy.partition=params"],
            d / "full": ["trainer.max_steps=12", *EPOCH],
            d / "first": ["trainer.max_steps=10", *EPOCH],
        },
    )
    ckpt = f"ckpt_path={d / 'first' / 'checkpoints' / 'last.ckpt'}"
    out |= launch(1, {d / "p1": STEPS, d / "resume1": ["trainer.max_steps=12", *EPOCH, ckpt]})
    out |= launch(
        4,
        {
            d / "p4-gpipe": [*STEPS, "strategy.schedule=gpipe"],
            d / "p4-1f1b": [*STEPS, "strategy.schedule=1f1b"],
            d / "resume4": ["trainer.max_steps=12", *EPOCH, ckpt],
        },
    )
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", ["p2-gpipe", "p2-1f1b", "p4-gpipe", "p4-1f1b", "p2-explicit", "p2-params"])
def test_pipeline_equals_single_process(runs, name):
    ref, run = runs["p1"], runs[name]
    got = run.summary
    assert got["steps"] == ref.summary["steps"] == 20
    assert_close_losses(got["losses"], ref.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert got["param_norm"] == pytest.approx(ref.summary["param_norm"], rel=1e-6)
    devices = int(name[1])
    assert got["world_size_start"] == got["world_size_end"] == devices
    expected = {"p2-explicit": [2, 4], "p2-params": None}.get(name, {2: [3, 3], 4: [2, 2, 1, 1]}[devices])
    if expected:
        assert got["partitions"][0]["layers_per_stage"] == expected
    assert got["losses"][-1] < got["losses"][0] - 0.3  # it learns


def test_params_partition_balances_parameter_counts(runs):
    from dynmo_lightning.balance import partition
    from dynmo_lightning.models import GPT

    model = GPT(n_layer=4, n_embd=32, n_head=4, block_size=32)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model.pipeline_layers()]
    # a block: two layer norms, q / k / v with biases on q and v only (k's adds the same to every score), the
    # attention's projection, the MLP
    block = 2 * 64 + 3 * 32 * 32 + 2 * 32 + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32)
    assert counts == [256 * 32 + 32 * 32, *[block] * 4, 256 * 32 + 2 * 32] and block == 12672
    expected = partition(counts, 2, method="optimal")
    assert runs["p2-params"].summary["partitions"][0]["layers_per_stage"] == expected == [3, 3]


def test_checkpoint_holds_unsplit_model_and_named_optimizer_state(runs):
    ckpt = load_whole(runs["first"].run_dir / "checkpoints" / "last.ckpt")  # P=2: a sharded directory
    names = set(ckpt["state_dict"])
    assert {"embed.wte.weight", "blocks.0.attn.q.weight", "blocks.3.mlp.fc.weight", "head.lm_head.weight"} <= names
    opt = ckpt["optimizer_states"][0]
    assert set(opt["state"]) == names
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(opt["state"]["head.lm_head.weight"])


@pytest.mark.parametrize("devices", [1, 4])
def test_resume_at_other_world_size(runs, devices):
    resumed, full = runs[f"resume{devices}"], runs["full"]
    # the two steps after the P=2 checkpoint equal the uninterrupted P=2 run's, and so do the final parameters
    assert_close_losses(resumed.summary["losses"], full.summary["losses"][10:])
    assert_close_params(resumed.checkpoint["state_dict"], full.checkpoint["state_dict"])


def test_checkpoint_loads_into_plain_model(runs):
    from dynmo_lightning.models import GPT

    ckpt = load_whole(runs["first"].run_dir / "checkpoints" / "final.ckpt")
    model = GPT(**ckpt["hyper_parameters"])
    model.configure_model()
    model.load_state_dict(ckpt["state_dict"])  # strict: exactly the unsplit model's keys
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)
