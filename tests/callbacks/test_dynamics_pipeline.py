"""Freezing and pruning under the pipeline: exact against one process even while the balancer moves frozen or
pruned layers around, and the default `dynamics=...` configs visibly act within 200 steps (and the balancer reacts).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import assert_close_losses, assert_close_params, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = ["trainer.max_steps=40"]
FREEZE = ["dynamics=freezing", "dynamics.start_step=10", "dynamics.check_every_n_steps=10", "dynamics.percentile=90"]
PRUNE = ["dynamics=pruning", "dynamics.start_step=5", "dynamics.end_step=30", "dynamics.every_n_steps=5"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=0"]
BALANCE = ["balancer=optimal", "balancer.every_n_steps=25", "balancer.min_gain=0.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamics")
    out = launch(1, {d / "freeze1": [*STEPS, *FREEZE], d / "prune1": [*STEPS, *PRUNE]})
    out |= launch(
        2,
        {
            d / "freeze2": [*STEPS, *FREEZE, *RANDOM],
            d / "prune2": [*STEPS, *PRUNE, *RANDOM],
            d / "freeze-default": ["trainer.max_steps=200", "dynamics=freezing", *BALANCE],
            d / "prune-default": ["trainer.max_steps=200", "dynamics=pruning", *BALANCE],
        },
    )
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", ["freeze", "prune"])
def test_dynamics_with_migrations_equal_one_process(runs, name):
    ref, run = runs[f"{name}1"], runs[f"{name}2"]
    assert len(run.summary["partitions"]) >= 5  # layers (frozen / pruned ones too) moved many times
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])


def test_freezing_acted_in_both(runs):
    for name in ("freeze1", "freeze2"):
        state = runs[name].checkpoint["callbacks"]["LayerFreezing"]
        assert state["frozen"] >= 1, name
        ckpt = runs[name].checkpoint
        frozen_weight = "embed.wte.weight"
        assert frozen_weight not in ckpt["optimizer_states"][0]["state"]  # frozen parameters left the optimizer


def test_pruned_shapes_identical_and_shrunk(runs):
    a, b = runs["prune1"].checkpoint["state_dict"], runs["prune2"].checkpoint["state_dict"]
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    hidden = sum(a[f"blocks.{i}.mlp.fc.weight"].shape[0] for i in range(4))
    assert hidden == 4 * 4 * 32 // 2  # 50% of the MLP neurons are gone


@pytest.mark.parametrize(("name", "key"), [("freeze-default", "LayerFreezing"), ("prune-default", "GradualPruning")])
def test_default_configs_act_within_200_steps_and_the_balancer_sees_it(runs, name, key):
    run = runs[name]
    callbacks = run.checkpoint["callbacks"]
    balancer = callbacks["DynMoBalancer"]
    assert len(balancer["history"]) == 8  # planned at steps 25, 50, ..., 200 from measured costs
    costs = [
        f + b for f, b in zip(balancer["tracker"]["values"]["fwd"], balancer["tracker"]["values"]["bwd"], strict=True)
    ]
    if key == "LayerFreezing":
        frozen = callbacks[key]["frozen"]
        assert frozen >= 1
        # a frozen block costs only its forward: well below any trainable block (the balancer plans with that)
        frozen_blocks = costs[1:frozen]
        trainable_blocks = costs[max(1, frozen) : -1]
        assert all(c < 0.75 * min(trainable_blocks) for c in frozen_blocks)
    else:
        assert callbacks[key]["sparsity"] == pytest.approx(0.5)
        widths = [run.checkpoint["state_dict"][f"blocks.{i}.mlp.fc.weight"].shape[0] for i in range(4)]
        assert sum(widths) == 4 * 4 * 32 // 2
    assert run.summary["losses"][-1] < run.summary["losses"][0] - 1.0
    assert torch.isfinite(torch.tensor(run.summary["losses"])).all()
