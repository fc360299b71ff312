"""Elastic for real, on loopback: a consolidation frees a whole "node", tells Slurm (a fake ``scontrol``), and every
survivor's view of the world agrees; torchrun runs, fixed-size and elastic, end with status 0 and no restart."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from support import SUPPORT
from support.fake_slurm import calls, env_with, install
from support.helpers import FREEZE, REPACK, TINY, assert_close_losses, assert_close_params, launch

from dynmo_lightning.launch import clean_env
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole
from dynmo_lightning.pipeline.elastic.survivors import open_store

SCRIPT = str(SUPPORT / "_elastic_train.py")
STEPS = ["trainer.max_steps=20"]
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


def _world(run_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((run_dir / "world").glob("*.json"))}


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    d = tmp_path_factory.mktemp("static")
    return launch(4, {d / "static": [*FREEZE, *STEPS]}, inject_costs=True)[d / "static"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two torchrun "nodes" (nodeA, nodeB) of two ranks each in a Slurm job; freezing makes two ranks enough."""
    d = tmp_path_factory.mktemp("two-nodes")
    log = install(d / "bin")
    store = open_store("127.0.0.1", timedelta(minutes=10))  # the agents' rendezvous, hosted here: no port race
    procs = []
    for node, name in enumerate(("nodeA", "nodeB")):
        cmd = [
            TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=dynmo-elastic", "--rdzv-conf=is_host=false",
            "--max-restarts=0", SCRIPT, *TINY, *FREEZE, *REPACK, *STEPS, "balancer.release_to=slurm", "logger.csv=true",
            "trainer.devices=2", "trainer.num_nodes=2", f"hydra.run.dir={d / name}", f"run_dir={d / 'run'}",
        ]  # fmt: skip
        env = env_with(d / "bin", {**clean_env(), "SLURM_JOB_ID": "4242", "SLURMD_NODENAME": name})
        procs.append(subprocess.Popen(cmd, env=env, cwd=d, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=800)[1] for p in procs]
    return {"dir": d, "codes": [p.returncode for p in procs], "errors": errors, "scontrol": calls(log)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_consolidation_frees_a_whole_node_tells_slurm_and_keeps_the_math(two_nodes, static):
    for node, (code, err) in enumerate(zip(two_nodes["codes"], two_nodes["errors"], strict=True)):
        assert code == 0, f"node {node}:\n{err[-5000:]}"
    run = two_nodes["dir"] / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size_start"] == 4 and summary["world_size_end"] == 2
    # The byte-cheapest survivors would be one rank per node; the planner kept both ranks of nodeA instead.
    (event,) = summary["releases"]
    assert event["released_ranks"] == [2, 3] and event["released_hosts"] == ["nodeB", "nodeB"]
    assert event["freed_nodes"] == ["nodeB"] and event["kept_nodes"] == ["nodeA"]
    # Slurm was asked to keep nodeA only, once, from the job's directory (where it writes the resize script).
    assert [c["argv"] for c in two_nodes["scontrol"]] == [["update", "JobId=4242", "NodeList=nodeA"]]
    assert (two_nodes["dir"] / "slurm_job_4242_resize.sh").is_file()
    assert_close_losses(summary["losses"], static.summary["losses"])
    final = load_whole(run / "checkpoints" / "final.ckpt")
    assert_close_params(final["state_dict"], static.checkpoint["state_dict"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_survivor_sees_the_same_new_world(two_nodes):
    world = _world(two_nodes["dir"] / "run")
    assert set(world) == {"rank0", "rank1", "released-2", "released-3"}  # the released processes were told
    assert {world[f"released-{r}"]["node"] for r in (2, 3)} == {"nodeB"}
    ports = set()
    for rank in (0, 1):
        view = world[f"rank{rank}"]
        assert view["node"] == "nodeA"
        assert view["env"] | {"MASTER_PORT": None} == {
            "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
            "GROUP_RANK": "0", "MASTER_PORT": None, "TORCHELASTIC_RESTART_COUNT": "0",
            # the resize script's environment, applied on every survivor
            "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "nodeA", "SLURM_TASKS_PER_NODE": None,
        }  # fmt: skip
        assert view["trainer"] == {
            "world_size": 2, "global_rank": rank, "local_rank": rank, "node_rank": 0, "num_nodes": 1,
            "is_global_zero": rank == 0,
        }  # fmt: skip
        assert view["module"] == {"global_rank": rank, "local_rank": rank} and view["rank_zero_only"] == rank
        assert view["dist"] == {"rank": rank, "world_size": 2}
        assert view["env"]["MASTER_PORT"] == str(view["main_port"])
        ports.add(view["main_port"])
    assert len(ports) == 1
    # the logger (rank 0's, old and new) kept logging after the shrink, up to the last step
    with open(two_nodes["dir"] / "run" / "csv" / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]
    summary = json.loads((two_nodes["dir"] / "run" / "summary.json").read_text())
    assert max(steps) == 19 > summary["releases"][0]["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nnodes", ["1", "1:2"])
def test_torchrun_fixed_and_elastic_runs_consolidate_without_a_restart(tmp_path, nnodes):
    store = open_store("127.0.0.1", timedelta(minutes=10))
    cmd = [
        TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=4", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=dynmo-elastic",
        "--rdzv-conf=is_host=false,last_call_timeout=1", "--max-restarts=3", "--monitor-interval=0.5",
        SCRIPT, *TINY, *FREEZE, *REPACK, *STEPS, "trainer.devices=4", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]  # every worker, the released ones included, exited 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size_start"] == 4 and summary["world_size_end"] == 2 and summary["steps"] == 20
    world = _world(tmp_path)
    assert {k for k in world if k.startswith("rank")} == {"rank0", "rank1"}
    assert all(world[f"rank{r}"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "0" for r in (0, 1))  # no restart
    assert "Restarting worker group" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shrink_then_grow_back_keeps_the_math(tmp_path):
    """4 -> 2 ranks while the load fits on two, back to 4 when it rises again (injected at step 12)."""
    model = ["model.n_layer=6", "strategy.n_microbatches=8"]  # 8 layers: four stages beat three once all cost
    elastic = [*REPACK, "balancer.repack_tolerance=0.15", "balancer.on_release=wait"]
    runs = launch(
        4,
        {
            tmp_path / "static": [*model, "trainer.max_steps=30"],
            tmp_path / "grow": [*model, *elastic, "trainer.max_steps=30"],
        },
        inject_costs=True,
        load_rises_at=12,
    )
    static, grown = runs[tmp_path / "static"], runs[tmp_path / "grow"]
    sizes = [w["world_size"] for w in grown.summary["world_size"]]
    assert sizes == [4, 2, 4], grown.summary["world_size"]
    history = grown.checkpoint["callbacks"]["DynMoBalancer"]["history"]
    (shrink,) = [h for h in history if "repack" in h]
    (back,) = [h for h in history if "grow" in h]
    assert shrink["step"] < 12 <= back["step"] and back["grow"] == 2 and len(back["proposed"]) == 4
    assert [len(p["layers_per_stage"]) for p in grown.summary["partitions"]][-1] == 4
    # the grown pipeline trained on exactly as one process would: losses and final parameters
    assert_close_losses(grown.summary["losses"], static.summary["losses"])
    assert_close_params(grown.checkpoint["state_dict"], static.checkpoint["state_dict"])
