"""DynMoBalancer: balancing never changes the math, it finds the optimum of measured costs, its state resumes."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
from support.helpers import assert_close_losses, assert_close_params, launch

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.balance import InfeasibleMemoryError, bottleneck, partition
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole
from dynmo_lightning.strategy.checks import layer_param_bytes, meta_layers

# a warm-up LR schedule runs too: migrations must leave the scheduler (bound to the same optimizer) intact
STEPS = ["trainer.max_steps=30", "model.warmup_steps=10"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=0"]
# Blocks with MLP hidden sizes 16x vs 1x the model width: the uniform split [4, 4] is badly unbalanced.
UNEVEN = ["model.n_layer=6", "model.n_embd=64", "model.mlp_ratio=[16,16,16,1,1,1]"]
BALANCE = ["balancer=optimal", "balancer.every_n_steps=5", "balancer.warmup_steps=2", "balancer.min_gain=0.02"]
EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("balance")
    out = launch(
        2,
        {
            d / "static": STEPS,
            d / "random2": [*STEPS, *RANDOM],
            d / "uneven": [*UNEVEN, *BALANCE, *STEPS],
            d / "uneven-first": [*UNEVEN, *BALANCE, "trainer.max_steps=10", *EPOCH],
            d / "uneven-resume": [
                *UNEVEN,
                *BALANCE,
                "trainer.max_steps=12",
                *EPOCH,
                f"ckpt_path={d / 'uneven-first' / 'checkpoints' / 'last.ckpt'}",
            ],
        },
        inject_costs=True,  # the balancer's decisions must not depend on this machine's timings
    )
    out |= launch(3, {d / "random3": [*STEPS, *RANDOM]})
    out |= launch(4, {d / "random4": [*STEPS, *RANDOM]})
    return {path.name: run for path, run in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["random2", "random3", "random4"])
def test_random_migrations_never_change_the_math(runs, name):
    static, run = runs["static"], runs[name]
    partitions = run.summary["partitions"]
    assert len(partitions) >= 5, partitions  # it really moved layers, many times
    assert_close_losses(run.summary["losses"], static.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], static.checkpoint["state_dict"])
    # optimizer state travelled with the layers
    got, ref = run.checkpoint["optimizer_states"][0]["state"], static.checkpoint["optimizer_states"][0]["state"]
    assert got.keys() == ref.keys()
    for name_ in ref:
        assert_close_params(
            {k: got[name_][k] for k in ("exp_avg", "exp_avg_sq")}, {k: ref[name_][k] for k in ("exp_avg", "exp_avg_sq")}
        )
        assert int(got[name_]["step"]) == int(ref[name_]["step"]) == 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_uneven_model_ends_on_the_optimum_of_its_costs(runs):
    run = runs["uneven"]
    state = run.checkpoint["callbacks"]["DynMoBalancer"]
    costs = [f + b for f, b in zip(state["tracker"]["values"]["fwd"], state["tracker"]["values"]["bwd"], strict=True)]
    final = run.summary["partitions"][-1]["layers_per_stage"]
    assert run.summary["partitions"][0]["layers_per_stage"] == [4, 4]
    # costs follow the widths (a 16x block costs several times a 1x block), and the balancer moved to their optimum
    assert min(costs[1:4]) > 2 * max(costs[4:7])
    assert final == partition(costs, 2, method="optimal") != [4, 4]
    assert bottleneck(costs, final) < bottleneck(costs, [4, 4])
    assert state["history"] and all("plan_s" in h for h in state["history"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resumed_run_starts_from_the_balanced_split(runs):
    first, resumed = runs["uneven-first"], runs["uneven-resume"]
    saved = load_whole(first.run_dir / "checkpoints" / "last.ckpt")
    balanced = saved["callbacks"]["DynMoBalancer"]["partition"]
    assert balanced != [4, 4]
    assert resumed.summary["partitions"][-1]["layers_per_stage"] == balanced or len(resumed.summary["partitions"]) > 2
    assert resumed.summary["partitions"][1]["layers_per_stage"] == balanced
    resumed_state = resumed.checkpoint["callbacks"]["DynMoBalancer"]["tracker"]
    assert resumed_state["samples"] > saved["callbacks"]["DynMoBalancer"]["tracker"]["samples"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "greedy"}, r"balancer.method='greedy' is not one of"),
        ({"every_n_steps": 0}, r"balancer.every_n_steps=0 must be an integer >= 1"),
        ({"smoothing": 0.0}, r"balancer.smoothing=0.0 must be in \(0, 1\]"),
        ({"profile_every_n_steps": 0}, r"profile_every_n_steps=0 must be >= 1"),
    ],
)
def test_bad_balancer_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynMoBalancer(**kwargs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weights_fit", [True, False])
def test_memory_capacity_no_partition_satisfies(weights_fit):
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)
    weights = sum(layer_param_bytes(meta_layers(model)))
    # Room for the weights but not for their gradients and Adam's state: found at the first check, on every process.
    # Not even room for the weights: refused by the launching process, before any worker starts.
    capacity = 1.2 * weights if weights_fit else 1000.0
    balancer = DynMoBalancer(every_n_steps=2, warmup_steps=0, memory_capacity=capacity)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=2),
        max_steps=4,
        callbacks=[balancer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    data = StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000)
    error, match = (InfeasibleMemoryError, "capacity") if weights_fit else (ValueError, "cannot hold the model")
    with pytest.raises(error, match=match):
        trainer.fit(model, datamodule=data)


def test_balancer_requires_dynmo_strategy():
    model = GPT(n_layer=2, n_embd=32, n_head=4, block_size=32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[DynMoBalancer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(TypeError, match="DynMoBalancer needs Trainer\\(strategy=DynMoStrategy"):
        trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000))
