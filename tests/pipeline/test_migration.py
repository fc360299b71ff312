"""Layer migration carries everything that defines a layer, keeps optimizer state, and frees the sender's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import SUPPORT
from support.helpers import launch_script

from dynmo_lightning.pipeline.stage.migration import Move, plan_moves
from dynmo_lightning.pipeline.stage.runtime import StagePlan

pytestmark = pytest.mark.timeout(300)


def test_plan_moves_in_global_order():
    old, new = StagePlan((3, 3), 2), StagePlan((1, 5), 2)
    assert plan_moves(old, new) == [Move(0, 1, (1, 2))]
    old, new = StagePlan((1, 1, 4), 3), StagePlan((3, 2, 1), 3)
    assert plan_moves(old, new) == [Move(1, 0, (1,)), Move(2, 0, (2,)), Move(2, 1, (3, 4))]
    assert plan_moves(old, old) == []


def test_v_placement_of_plans_and_moves():
    plan = StagePlan((2, 1, 1, 2), 2, "zbv")  # stages 0 and 3 on rank 0, 1 and 2 on rank 1
    assert [plan.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    assert plan.stages_of_rank(0) == [0, 3] and plan.stages_of_rank(1) == [1, 2]
    assert plan.layers_of_rank(0) == [0, 1, 4, 5] and plan.rank_of_layer(5) == 0
    new = plan.with_layers((1, 2, 2, 1))
    assert new.schedule == "zbv" and new.rank_of_layer(4) == 1
    assert plan_moves(plan, new) == [Move(0, 1, (1, 4))]
    looped = StagePlan((2, 1, 1, 2), 2, "interleaved_zb")
    assert [looped.rank_of_stage(s) for s in range(4)] == [0, 1, 0, 1]
    assert plan != StagePlan((2, 1, 1, 2), 2, "1f1b")  # the placement is part of the plan
    with pytest.raises(ValueError, match="do not spread evenly"):
        StagePlan((1, 1, 1), 2)


@pytest.mark.slow
def test_layers_move_with_attributes_buffers_flags_and_optimizer_state(tmp_path: Path):
    out = tmp_path / "result"
    launch_script(2, SUPPORT / "_migration_script.py", str(out), log_dir=tmp_path)
    r0 = json.loads(Path(f"{out}.rank0.json").read_text())
    r1 = json.loads(Path(f"{out}.rank1.json").read_text())
    assert r0["moves"] == r1["moves"] == [[1, 2]]
    assert r0["local"] == [0] and r1["local"] == [1, 2, 3]
    assert r0["freed"]  # the sender no longer holds the moved parameters
    assert r0["n_params"] == r0["opt_params"] == 2  # only layer 0 (weight, bias) is left on rank 0
    # weights in group 0, trainable biases none (frozen): every optimized parameter kept its group
    assert r1["checks"] == {"1.weight": 0, "2.weight": 0}
    # Transient memory (the planner's numbers: parameters, buffers and optimizer state of the moved layers). The
    # sender allocates only the coalescing buffer of its small tensors (and one byte each way to open the link) and
    # no longer holds the outgoing layers' gradients; the receiver allocates the payload once, in its final memory,
    # plus that buffer: no second copy of anything.
    assert r0["payload"] == r1["payload"] > 4 * 128 * 128 * 3
    assert r0["small"] <= r0["allocated"] <= r0["small"] + 2
    assert r1["payload"] + r1["small"] <= r1["allocated"] <= r1["payload"] + r1["small"] + 2
    assert any(r0["grads_before"]) and not any(r0["grads_at_commit"])
    assert 0 <= r0["setup_s"] <= r0["seconds"] and 0 <= r1["setup_s"] <= r1["seconds"]
