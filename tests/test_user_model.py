"""A user's own model and DataLoader under DynMoStrategy train exactly as plain single-device Lightning does.

The reference is Lightning itself on one device (no DynMoStrategy): the pipeline must keep the user's data order
(Lightning would re-shuffle a sequential loader), drop_last, clipping and optimizer steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import SUPPORT
from support.helpers import assert_close_losses, assert_close_params, launch_script
from support.user_model import fit

from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

SCRIPT = SUPPORT / "_user_script.py"


@pytest.fixture(scope="module")
def reference():
    """Plain Lightning, one device, the user's loader (batch 16), and the same with batch 32."""
    out = {}
    for batch in (16, 32):
        result = fit(batch_size=batch)
        state = {k: v.clone() for k, v in result["model"].state_dict().items()}
        out[batch] = {"losses": result["losses"], "state": state}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    launch_script(1, SCRIPT, str(d), "p1:", "p1-shuffled:shuffle=1", log_dir=d / "logs")
    launch_script(2, SCRIPT, str(d), "p2:", "p2-random:random=1", "p2-shuffled:shuffle=1", log_dir=d / "logs")
    launch_script(4, SCRIPT, str(d), "p4:", "p4-random:random=1", "dp2pp2:dp=2,batch=16", log_dir=d / "logs")
    return d


def _load(d: Path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = json.loads((d / f"{name}.json").read_text())["losses"]
    state = load_whole(d / f"{name}.ckpt")["state_dict"]  # sharded (P > 1) or one file
    return losses, state


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["p1", "p2", "p4", "p2-random", "p4-random"])
def test_pipeline_equals_plain_lightning_on_one_device(runs, reference, name):
    losses, state = _load(runs, name)
    assert len(losses) == 24
    assert_close_losses(losses, reference[16]["losses"])
    assert_close_params(state, reference[16]["state"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_replicas_with_the_users_loader_equal_one_device_with_the_doubled_batch(runs, reference):
    losses, state = _load(runs, "dp2pp2")
    assert_close_losses(losses, reference[32]["losses"])
    assert_close_params(state, reference[32]["state"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_shuffled_loader_gives_every_stage_and_width_the_same_order(runs):
    # All stages must draw the same batches (they would not from the global RNG, which dropout consumes per stage):
    # with a shared seed, P=2 sees exactly what P=1 sees.
    one, two = _load(runs, "p1-shuffled"), _load(runs, "p2-shuffled")
    assert_close_losses(two[0], one[0])
    assert_close_params(two[1], one[1])
    assert two[0] != _load(runs, "p2")[0]  # and it really is another order than the sequential one
