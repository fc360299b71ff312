"""Recovery by restart (issue 48): a lost node under torchrun's elastic agent, and checkpoints in the background.

A job of two loopback "nodes" loses one at step 30 of 60 (its agent and workers SIGKILLed): the survivors' agent
restarts them, they resume from the run's newest checkpoint themselves on the smaller world and finish; their final
weights and optimizer state equal a run resumed by hand from the same checkpoint on the same world. Background
checkpoints hold exactly what blocking ones hold, though training changed the weights while they were written.
"""

from __future__ import annotations

import sys

import pytest
import torch
from support import SUPPORT

from dynmo_lightning.bench import recovery
from dynmo_lightning.launch import run_ranks
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _assert_same(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(v, b["state_dict"][k], rtol=0, atol=0, msg=k)
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys()
    for name, state in sa.items():
        for key, v in state.items():
            torch.testing.assert_close(v, sb[name][key], rtol=0, atol=0, msg=f"{name}.{key}")


def test_a_lost_node_restarts_on_the_survivors_and_resumes_exactly(tmp_path):
    run, ref = tmp_path / "killed", tmp_path / "by-hand"
    codes = recovery.run_job(run, 2, 2, ["--steps", "60", "--every", "10", "--kill-step", "30"])
    assert codes[0] == 0 and codes[1] == -9, codes  # node B died; node A's agent finished the job
    facts = recovery.measure(run)
    assert facts["final_step"] == 60 and facts["world_before"] == 4 and facts["world_after"] == 2, facts
    assert facts["steps_lost"] <= 10 and facts["resumed_from_step"] >= 20, facts
    start = recovery.records(run)[-1]
    assert start["restart"] >= 1
    resumed = run / "checkpoints" / f"epoch=0-step={facts['resumed_from_step']}.ckpt"
    codes = recovery.run_job(ref, 1, 2, ["--steps", "60", "--every", "10", "--ckpt", str(resumed)])
    assert codes == [0]
    assert all(r["restart"] == 0 and r["world"] == 2 for r in recovery.records(ref))
    _assert_same(load_whole(run / "checkpoints" / "last.ckpt"), load_whole(ref / "checkpoints" / "last.ckpt"))


def test_background_checkpoints_hold_what_blocking_ones_hold(tmp_path):
    script = [sys.executable, str(SUPPORT / "_async_ckpt_script.py")]
    for name, background in (("blocking", "0"), ("background", "1")):
        codes = run_ranks(2, [*script, str(tmp_path / name), background], log_dir=tmp_path, tag=name, timeout=300)
        assert codes == [0, 0], (tmp_path / f"{name}.rank0.log").read_text()[-3000:]
    names = sorted(p.name for p in (tmp_path / "blocking").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert sorted(p.name for p in (tmp_path / "background").iterdir()) == names  # no temporary left behind
    for name in names:
        _assert_same(load_whole(tmp_path / "blocking" / name), load_whole(tmp_path / "background" / name))


def test_a_soak_of_random_kills_loses_nothing(tmp_path):
    # three processes killed in random phases at random steps, one per attempt; epochs end at the checkpoints, so
    # the killed job must end bit-identical to one never killed (red without the epoch count's mending: resumed
    # twice, Lightning replays an epoch's batches)
    facts = recovery.soak(tmp_path, kills=3, steps=60, seed=0)
    assert facts["kills"] == 3 and facts["restarts"] == 3 and facts["agent_exit"] == 0, facts
    assert facts["final_step"] == 60 and all(0 <= lost <= 10 for lost in facts["steps_lost"]), facts
    assert facts["exact"], facts


def test_a_requeued_slurm_job_resumes_where_it_stopped(tmp_path, monkeypatch):
    # Slurm requeues the same command with SLURM_RESTART_COUNT > 0: it resumes from the run's newest checkpoint
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    argv = [sys.executable, "-m", "dynmo_lightning.bench.recovery", "worker", "--dir", str(tmp_path), "--every", "10"]
    assert run_ranks(2, [*argv, "--steps", "20"], log_dir=tmp_path, tag="first", timeout=300) == [0, 0]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert run_ranks(2, [*argv, "--steps", "30"], log_dir=tmp_path, tag="requeued", timeout=300) == [0, 0]
    starts = [r for r in recovery.records(tmp_path) if r["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 20], starts
    assert starts[1]["ckpt"] is not None and starts[1]["ckpt"].startswith(str(tmp_path / "checkpoints")), starts
    assert max(r["step"] for r in recovery.records(tmp_path)) == 30


def test_a_replacement_node_grows_the_job_back(tmp_path):
    # node B lost at step 20; once the survivors reached step 25 a new node C starts: the survivors' agent restarts
    # them into the grown world, whose processes all resume from the newest checkpoint (C's with a restart count of
    # 0); the end equals a run resumed by hand from that checkpoint on the grown world
    facts = recovery.grow_back(tmp_path, steps=60, every=10, kill_step=20, join_at=25)
    assert facts["worlds"] == [4, 2, 4] and facts["final_step"] == 60, facts
    assert facts["exit"][0] == 0 and facts["exit"][2] == 0, facts
    assert facts["resumed_from_step"] >= 20 and facts["steps_rerun"] <= 10, facts
    ref = tmp_path / "by-hand"
    resumed = tmp_path / "grow-back" / "checkpoints" / f"epoch=0-step={facts['resumed_from_step']}.ckpt"
    assert recovery.run_job(ref, 2, 2, ["--steps", "60", "--every", "10", "--ckpt", str(resumed)]) == [0, 0]
    _assert_same(load_whole(tmp_path / "grow-back" / "checkpoints" / "last.ckpt"),
                 load_whole(ref / "checkpoints" / "last.ckpt"))  # fmt: skip
