"""Freezing and pruning under the pipeline: exact against one process even while the balancer moves frozen or
pruned layers around, and the default `dynamics=...` configs visibly act within 200 steps (and the balancer reacts).
"""

from __future__ import annotations

import csv

import pytest
import torch
from support.helpers import assert_close_losses, assert_close_params, launch

from dynmo_lightning.balance import partition

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = ["trainer.max_steps=40"]
FREEZE = ["dynamics=freezing", "dynamics.start_step=10", "dynamics.check_every_n_steps=10", "dynamics.percentile=90"]
PRUNE = ["dynamics=pruning", "dynamics.start_step=5", "dynamics.end_step=30", "dynamics.every_n_steps=5"]
EXIT = ["dynamics=early_exit", "dynamics.warmup_steps=5", "dynamics.ramp_steps=5", "dynamics.threshold=0.6"]
MOD = ["dynamics=mod", "dynamics.start_step=5", "dynamics.anneal_steps=10", "dynamics.capacity=0.25"]
MOE = ["dynamics=moe", "dynamics.n_experts=4", "dynamics.capacity_factor=1.0"]
SPARSE = ["dynamics=sparse_attention", "dynamics.attn_block=8", "dynamics.target_coverage=0.8"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=0"]
BALANCE = ["balancer=optimal", "balancer.every_n_steps=25", "balancer.min_gain=0.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamics")
    one = {
        "freeze1": FREEZE,
        "prune1": PRUNE,
        "exit1": EXIT,
        "mod1": MOD,
        "moe1": MOE,
        "sparse1": SPARSE,
        "moe1-noaux": [*MOE, "dynamics.aux_loss_coef=0", "dynamics.z_loss_coef=0"],
    }
    out = launch(1, {d / name: [*STEPS, *dynamic] for name, dynamic in one.items()})
    csv_log = ["logger.csv=true", "trainer.log_every_n_steps=10"]
    two = {
        "freeze2": [*STEPS, *FREEZE, *RANDOM],
        "prune2": [*STEPS, *PRUNE, *RANDOM],
        "exit2": [*STEPS, *EXIT, *RANDOM],
        "mod2": [*STEPS, *MOD, *RANDOM],
        "moe2": [*STEPS, *MOE, *RANDOM],
        "sparse2": [*STEPS, *SPARSE, *RANDOM],
        "freeze-default": ["trainer.max_steps=200", "dynamics=freezing", *BALANCE],
        "prune-default": ["trainer.max_steps=200", "dynamics=pruning", *BALANCE],
        "exit-default": ["trainer.max_steps=200", "dynamics=early_exit", *BALANCE, *csv_log],
        "mod-default": ["trainer.max_steps=200", "dynamics=mod", *BALANCE, *csv_log],
        "moe-default": ["trainer.max_steps=200", "dynamics=moe", *BALANCE, *csv_log],
        "sparse-default": ["trainer.max_steps=200", "dynamics=sparse_attention", *BALANCE, *csv_log],
    }
    # the balancer's decisions must not depend on this machine's timings (random splits ignore costs anyway)
    out |= launch(2, {d / name: overrides for name, overrides in two.items()}, inject_costs=True)
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", ["freeze", "prune", "exit", "mod", "moe", "sparse"])
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
    # planned every 25 steps from measured costs, and again soon after each freeze/prune event (the balancer reacts
    # to the dynamics' events as soon as it has fresh profiles, rather than waiting for the next period)
    assert _planned_every_25_steps(balancer)
    costs = [
        f + b for f, b in zip(balancer["tracker"]["values"]["fwd"], balancer["tracker"]["values"]["bwd"], strict=True)
    ]
    # it moved to the optimal split of the costs it tracked (a frozen or pruned layer costs less)
    assert run.summary["partitions"][-1]["layers_per_stage"] == partition(costs, 2, method="optimal")
    if key == "LayerFreezing":
        assert callbacks[key]["frozen"] >= 1
    else:
        assert callbacks[key]["sparsity"] == pytest.approx(0.5)
        widths = [run.checkpoint["state_dict"][f"blocks.{i}.mlp.fc.weight"].shape[0] for i in range(4)]
        assert sum(widths) == 4 * 4 * 32 // 2
    assert run.summary["losses"][-1] < run.summary["losses"][0] - 1.0
    assert torch.isfinite(torch.tensor(run.summary["losses"])).all()


def _planned_every_25_steps(balancer: dict) -> bool:
    steps = [h["step"] for h in balancer["history"]]
    return steps == sorted(steps) and set(range(25, 201, 25)) <= set(steps)


def _last_logged(run, key: str) -> float:
    with open(run.run_dir / "csv" / "metrics.csv") as f:
        values = [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    return values[-1]


def test_early_exit_and_mod_defaults_act_within_200_steps(runs):
    exit_run, mod_run = runs["exit-default"], runs["mod-default"]
    assert _last_logged(exit_run, "early_exit/active_frac") < 1.0  # tokens exit by the end of the run
    thresholds = [v for k, v in exit_run.checkpoint["state_dict"].items() if k.endswith("exit_gate.threshold")]
    assert thresholds and all(float(t) == pytest.approx(0.9) for t in thresholds)
    assert _last_logged(mod_run, "mod/capacity") == pytest.approx(0.125)
    assert _last_logged(mod_run, "mod/layer2/routed_frac") == pytest.approx(0.125, abs=0.02)
    for run in (exit_run, mod_run):
        assert _planned_every_25_steps(run.checkpoint["callbacks"]["DynMoBalancer"])
        assert run.summary["losses"][-1] < run.summary["losses"][0] - 1.0


def test_moe_aux_loss_crosses_stages_and_reaches_first_stage_routers(runs):
    with_aux, without_aux = runs["moe1"].summary["losses"], runs["moe1-noaux"].summary["losses"]
    assert with_aux[0] != without_aux[0]  # the auxiliary losses are part of the training loss
    # ... and the P=2 pipeline (layers moving between the stages every 3 steps) reproduces it exactly, routers on
    # the first stage included: their gradients came back through the stage boundary with the carried loss
    ref, run = runs["moe1"].checkpoint["state_dict"], runs["moe2"].checkpoint["state_dict"]
    routers = [k for k in ref if k.endswith("mlp.router.weight")]
    assert routers and all(torch.equal(ref[k], run[k]) for k in routers)


def test_moe_and_sparse_attention_defaults_act_within_200_steps(runs):
    moe, sparse = runs["moe-default"], runs["sparse-default"]
    assert _last_logged(moe, "moe/layer2/max_load") > 0.25  # routing is uneven (4 experts)
    densities = [float(v) for k, v in sparse.checkpoint["state_dict"].items() if k.endswith("attn.density")]
    assert densities and min(densities) < 1.0  # densities adapted away from dense
    for run in (moe, sparse):
        assert _planned_every_25_steps(run.checkpoint["callbacks"]["DynMoBalancer"])
        assert run.summary["val_loss"] < run.summary["losses"][0] - 1.0
