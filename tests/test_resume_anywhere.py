"""Resume anywhere: a checkpoint written at P=4 with balancer and dynamics state (frozen prefix, pruned shapes, EMA
costs, partition) resumes at P=2 and P=1 with identical parameters and next-step losses; same seed and config give
identical losses run after run."""

from __future__ import annotations

import pytest
from support.helpers import assert_close_losses, assert_close_params, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]
BALANCE = ["balancer=optimal", "balancer.every_n_steps=4", "balancer.warmup_steps=1", "balancer.min_gain=0.0"]
DYNAMICS = {
    "freeze": ["dynamics=freezing", "dynamics.mode=schedule", "dynamics.schedule={0:4,1:6}", "dynamics.start_step=0"],
    "prune": ["dynamics=pruning", "dynamics.start_step=2", "dynamics.end_step=8", "dynamics.every_n_steps=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("anywhere")
    four = {}
    for name, dyn in DYNAMICS.items():
        four[d / f"{name}-full"] = [*dyn, *BALANCE, *EPOCH, "trainer.max_steps=12"]
        four[d / f"{name}-first"] = [*dyn, *BALANCE, *EPOCH, "trainer.max_steps=10"]
    four[d / "again"] = [*DYNAMICS["freeze"], *BALANCE, *EPOCH, "trainer.max_steps=12"]
    out = launch(4, four)
    for world in (2, 1):
        out |= launch(
            world,
            {
                d / f"{name}-resume{world}": [
                    *dyn,
                    *BALANCE,
                    *EPOCH,
                    "trainer.max_steps=12",
                    f"ckpt_path={d / f'{name}-first' / 'checkpoints' / 'last.ckpt'}",
                ]
                for name, dyn in DYNAMICS.items()
            },
        )
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("name", ["freeze", "prune"])
def test_resume_at_a_smaller_world(runs, name, world):
    full, resumed = runs[f"{name}-full"], runs[f"{name}-resume{world}"]
    assert resumed.summary["world_size_start"] == world
    assert_close_losses(resumed.summary["losses"], full.summary["losses"][10:])
    assert_close_params(resumed.checkpoint["state_dict"], full.checkpoint["state_dict"])
    state = resumed.checkpoint["callbacks"]
    assert (
        state["DynMoBalancer"]["tracker"]["samples"]
        > runs[f"{name}-first"].checkpoint["callbacks"]["DynMoBalancer"]["tracker"]["samples"]
    )  # the EMA costs were restored and kept being updated
    if name == "freeze":
        assert state["LayerFreezing"]["frozen"] == 2
    else:
        assert state["GradualPruning"]["sparsity"] == pytest.approx(0.5)


def test_same_seed_same_losses(runs):
    assert runs["again"].summary["losses"] == runs["freeze-full"].summary["losses"]  # bit-identical on CPU
