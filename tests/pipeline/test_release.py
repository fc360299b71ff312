"""Release handlers and the survivors' view of the world, without processes: what the job manager is told and what
every survivor's environment says after a shrink."""

from __future__ import annotations

import json
import logging
import os

import pytest
from support.fake_slurm import calls, env_with, install

from dynmo_lightning import DynMoBalancer
from dynmo_lightning.pipeline.elastic.release import (
    CommandRelease,
    NoRelease,
    ReleaseEvent,
    SlurmRelease,
    apply_environment,
    describe,
    make_release_handler,
    notify,
    parse_resize_script,
)
from dynmo_lightning.pipeline.elastic.survivors import world_view

#: Four ranks on two nodes, released 2 and 3: node "b" is free.
HOSTS = [(0, "a"), (0, "a"), (1, "b"), (1, "b")]


def test_describe_names_released_ranks_hosts_and_whole_nodes():
    event = describe(12, [0, 1], HOSTS, 4)
    assert event == ReleaseEvent(12, [2, 3], ["b", "b"], ["b"], ["a"], 4, 2)
    # one rank per node released: nothing whole is freed
    event = describe(12, [0, 2], HOSTS, 4)
    assert event.released_ranks == [1, 3] and event.freed_nodes == [] and event.kept_nodes == ["a", "b"]
    assert json.loads(event.to_json())["released_hosts"] == ["a", "b"]


def test_world_view_after_a_shrink():
    nodes = [0, 0, 1, 1, 2, 2]
    # survivors: old ranks 0, 1 (node 0) and 4 (node 2); node 2 becomes node 1
    views = {me: world_view([0, 1, 4], me, nodes, 29500) for me in (0, 1, 4)}
    assert [(v.rank, v.local_rank, v.local_world_size, v.node_rank, v.num_nodes) for v in views.values()] == [
        (0, 0, 2, 0, 2),
        (1, 1, 2, 0, 2),
        (2, 0, 1, 1, 2),
    ]
    env = views[4].environ()
    assert env == {
        "WORLD_SIZE": "3",
        "RANK": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": "1",
        "GROUP_RANK": "1",
        "MASTER_PORT": "29500",
    }


def test_resize_script_is_parsed_like_a_shell_would():
    text = 'export SLURM_NODELIST="n[1-2]"\nexport SLURM_NNODES=2\nunset SLURM_TASKS_PER_NODE\n# comment\n'
    assert parse_resize_script(text) == {"SLURM_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": None}


def test_slurm_handler_shrinks_the_allocation_to_the_kept_nodes(tmp_path, monkeypatch):
    log = install(tmp_path / "bin")
    monkeypatch.setenv("PATH", env_with(tmp_path / "bin", dict(os.environ))["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    handler = SlurmRelease(workdir=tmp_path)
    env = handler(describe(5, [0, 1], HOSTS, 4))
    assert [c["argv"] for c in calls(log)] == [["update", "JobId=4242", "NodeList=a"]]
    assert env is not None and env["SLURM_NNODES"] == "1" and env["SLURM_JOB_NODELIST"] == "a"
    assert env["SLURM_TASKS_PER_NODE"] is None
    # no whole node free: the allocation is left alone
    assert handler(describe(5, [0, 2], HOSTS, 4)) is None and len(calls(log)) == 1


def test_a_failing_handler_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    install(tmp_path / "bin", fail=True)
    monkeypatch.setenv("PATH", env_with(tmp_path / "bin", dict(os.environ))["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with caplog.at_level(logging.WARNING):
        assert notify(SlurmRelease(workdir=tmp_path), describe(5, [0, 1], HOSTS, 4)) == {}
    assert "already completing" in caplog.text
    monkeypatch.delenv("SLURM_JOB_ID")
    with caplog.at_level(logging.WARNING):
        assert notify(SlurmRelease(workdir=tmp_path), describe(5, [0, 1], HOSTS, 4)) == {}
    assert "outside a Slurm job" in caplog.text


def test_command_handler_reads_the_event_on_stdin(tmp_path):
    out = tmp_path / "event.json"
    event = describe(7, [0, 1], HOSTS, 4)
    assert notify(CommandRelease(f"cat > {out}"), event) == {}
    assert json.loads(out.read_text())["freed_nodes"] == ["b"]
    with pytest.raises(RuntimeError, match="exited with status 3"):
        CommandRelease("exit 3")(event)


def test_handlers_by_name_and_bad_settings():
    assert isinstance(make_release_handler("none"), NoRelease)
    assert isinstance(make_release_handler("slurm"), SlurmRelease)

    def mine(event):
        return None

    assert make_release_handler(mine) is mine
    with pytest.raises(ValueError, match=r"balancer.release_to='lsf' is not one of \['none', 'slurm', 'command'\]"):
        DynMoBalancer(release_to="lsf")
    with pytest.raises(ValueError, match=r"balancer\.release_to=command needs balancer\.release_command"):
        DynMoBalancer(release_to="command")


def test_apply_environment_sets_and_unsets(monkeypatch):
    monkeypatch.setenv("DYNMO_TEST_GONE", "1")
    apply_environment({"DYNMO_TEST_SET": 3, "DYNMO_TEST_GONE": None})
    assert os.environ["DYNMO_TEST_SET"] == "3" and "DYNMO_TEST_GONE" not in os.environ
    monkeypatch.delenv("DYNMO_TEST_SET")
