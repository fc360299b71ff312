"""Data-parallel replicas of the pipeline (DP x PP): same math as one replica with the same global batch, replicas
grown from processes a repack releases, and a two-node job on loopback (two torchrun node processes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from support.helpers import (
    DP2,
    FREEZE,
    REPACK,
    TINY,
    assert_close_losses,
    assert_close_model,
    assert_close_params,
    launch,
)

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.launch import clean_env
from dynmo_lightning.pipeline.elastic.survivors import open_store
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout

STEPS = ["trainer.max_steps=12"]
# Blocks 0-3 and the embedding freeze at step 3 (FREEZE); the repack at step 5 then packs 4 stages onto 2.
GROW = [
    *REPACK,
    "balancer.on_release=data_parallel",
    # No re-partition within a pipeline (a relative gain never exceeds 1): only the repack changes the split.
    "balancer.min_gain=1.0",
]
# 16 experts in every block for 64 tokens per micro-batch and replica: experts go unused in one replica (or in the
# last micro-batch only) while the other uses them. Dropless, no load-balancing loss (a product of per-call means):
# routing is per token, so two replicas of half the batch compute what one replica does.
MOE = [
    "dynamics=moe",
    "dynamics.n_experts=16",
    "dynamics.every=1",
    "dynamics.capacity_factor=null",
    "dynamics.aux_loss_coef=0",
]
# Tied embeddings, and a new random partition every 2 steps: every replica migrates (alike) and keeps its tie exact.
TIED_RANDOM = [
    "model.tie_embeddings=true",
    "balancer=optimal",
    "balancer.method=random",
    "balancer.every_n_steps=2",
    "balancer.warmup_steps=0",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    # Pipeline-only runs are bit-identical for any number of stages: two stages are the reference for four.
    out = launch(
        2,
        {
            d / "pp2": STEPS,
            d / "pp2-tied": [*STEPS, *TIED_RANDOM],
            d / "pp2-freeze": [*FREEZE, "trainer.max_steps=20"],
            d / "pp2-moe": [*STEPS, *MOE],
        },
    )
    # The growing run is last: it rebuilds the world of these processes.
    out |= launch(
        4,
        {
            d / "dp2": [*STEPS, *DP2],
            d / "dp2-tied": [*STEPS, *DP2, *TIED_RANDOM],
            # densities adapt to each replica's data: the replicas must still end identical
            d / "dp2-sparse": [*STEPS, *DP2, "dynamics=sparse_attention"],
            d / "dp2-moe": [*STEPS, *DP2, *MOE],
            d / "grow": [*FREEZE, *GROW, "trainer.max_steps=20"],
        },
        inject_costs=True,  # when and where the repack happens must not depend on this machine's timings
    )
    return {path.name: run for path, run in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_replicas_of_two_stages_equal_one_replica(runs):
    ref, dp = runs["pp2"], runs["dp2"]
    assert dp.summary["world_size"] == [{"step": 0, "world_size": 4, "replicas": 2}]
    assert dp.summary["replicas_in_sync"]
    assert len(dp.summary["partitions"][-1]["layers_per_stage"]) == 2
    assert_close_losses(dp.summary["losses"], ref.summary["losses"])
    assert_close_params(dp.checkpoint["state_dict"], ref.checkpoint["state_dict"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicas_rebalance_alike_and_keep_ties_exact(runs):
    ref, dp = runs["pp2-tied"], runs["dp2-tied"]
    assert len(dp.summary["partitions"]) > 3  # migrated several times
    assert dp.summary["replicas_in_sync"]
    assert dp.summary["partitions"] == ref.summary["partitions"]
    assert_close_losses(dp.summary["losses"], ref.summary["losses"])
    assert_close_model(dp.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert torch.equal(
        dp.checkpoint["state_dict"]["embed.wte.weight"], dp.checkpoint["state_dict"]["head.lm_head.weight"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replicas_stay_identical_when_layers_adapt_to_their_data(runs):
    summary = runs["dp2-sparse"].summary
    assert summary["replicas_in_sync"] and summary["replicas_end"] == 2
    density = runs["dp2-sparse"].checkpoint["state_dict"]["blocks.0.attn.density"]
    assert float(density) < 1.0  # the density did adapt


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_experts_one_replica_did_not_use_are_averaged_as_zero(runs):
    ref, dp = runs["pp2-moe"], runs["dp2-moe"]
    assert dp.summary["replicas_in_sync"]
    assert_close_losses(dp.summary["losses"], ref.summary["losses"])
    # Each replica sums its own tokens' expert gradients (a different association of the same terms): the model is
    # equal within 1e-5, and no tensor is off by more than float noise through Adam (an expert whose gradient was
    # not averaged would be off by about the learning rate).
    assert_close_model(dp.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert_close_params(dp.checkpoint["state_dict"], ref.checkpoint["state_dict"], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_released_processes_grow_a_second_replica_and_the_math_holds(runs):
    ref, grown = runs["pp2-freeze"].summary, runs["grow"].summary
    sizes = grown["world_size"]
    assert sizes[0] == {"step": 0, "world_size": 4, "replicas": 1}
    assert sizes[-1]["world_size"] == 4 and sizes[-1]["replicas"] == 2 and grown["replicas_end"] == 2
    assert grown["replicas_in_sync"]  # the grown replica (copied layers, optimizer state) stayed identical
    assert [len(p["layers_per_stage"]) for p in grown["partitions"]] == [4, 2]
    assert_close_losses(grown["losses"], ref["losses"])
    assert_close_params(runs["grow"].checkpoint["state_dict"], runs["pp2-freeze"].checkpoint["state_dict"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_nodes_on_loopback(runs, tmp_path: Path):
    """Two torchrun node processes (``--nnodes=2 --node_rank=0/1``), two ranks each: DP=2 x PP=2 across nodes."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    # The node agents meet at a store this test hosts: its port is ours from the moment it is opened (no race).
    store = open_store("127.0.0.1", timedelta(minutes=10))
    nodes = []
    for node in range(2):
        cmd = [
            torchrun,
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}",
            "--rdzv-id=dynmo-two-nodes",
            "--rdzv-conf=is_host=false",
            "-m",
            "dynmo_lightning.cli",
            *TINY,
            *STEPS,
            *DP2,
            "trainer.devices=2",
            "trainer.num_nodes=2",
            f"hydra.run.dir={tmp_path / f'node{node}'}",
            f"run_dir={tmp_path / 'run'}",
        ]
        nodes.append(subprocess.Popen(cmd, env=clean_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=800)[1] for p in nodes]
    for node, (p, err) in enumerate(zip(nodes, errors, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{err[-5000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == [{"step": 0, "world_size": 4, "replicas": 2}]
    assert_close_losses(summary["losses"], runs["pp2"].summary["losses"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_slurm_job_of_two_nodes(runs, tmp_path: Path):
    """Four tasks with the variables ``srun --nodes=2 --ntasks-per-node=2`` sets: Lightning's SLURMEnvironment."""
    # The tasks meet at a store this test hosts, as they would at the agent's under torchrun: no port race.
    store = open_store("127.0.0.1", timedelta(minutes=10))
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "dynmo",
        "SLURM_NTASKS": "4",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    cmd = [
        sys.executable,
        "-m",
        "dynmo_lightning.cli",
        *TINY,
        *STEPS,
        *DP2,
        "trainer.devices=2",
        "trainer.num_nodes=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    tasks = []
    for rank in range(4):
        env = {
            **clean_env(),
            **slurm,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
        }
        tasks.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True))
    errors = [t.communicate(timeout=800)[1] for t in tasks]
    for rank, (t, err) in enumerate(zip(tasks, errors, strict=True)):
        assert t.returncode == 0, f"task {rank}:\n{err[-5000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == [{"step": 0, "world_size": 4, "replicas": 2}]
    assert_close_losses(summary["losses"], runs["pp2"].summary["losses"])


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_data_parallel_size_must_be_positive(size):
    with pytest.raises(ValueError, match=r"strategy.data_parallel_size=.* must be a positive integer"):
        DynMoStrategy(data_parallel_size=size)


def _layout(replicas, parts=None) -> ReplicaLayout:
    """A job layout set by hand (no processes): for the regrouping rule alone."""
    shards = [(d, len(replicas)) for d in range(len(replicas))]
    return ReplicaLayout(replicas, shards, parts or [(0, 1)] * len(replicas))


def _regroup(layout, keep, on_release, batch_size, n_microbatches=4):
    new, copies = layout.regroup(keep, on_release, batch_size, n_microbatches)
    return new.replicas, new.shards, new.parts, copies


def test_regroup_turns_whole_pipelines_of_released_ranks_into_replicas():
    # one replica of 4 stages packs onto 2: the two released ranks make a second replica of the same shard
    replicas, shards, parts, copies = _regroup(_layout([[0, 1, 2, 3]]), [0, 1], "data_parallel", 16)
    assert replicas == [[0, 1], [2, 3]] and shards == [(0, 1), (0, 1)] and parts == [(0, 2), (1, 2)]
    assert copies == [(0, 2), (1, 3)]
    # 2 replicas of 3 stages onto 1: each makes 3 replicas of one stage, each takes a third of its shard's batch
    replicas, shards, parts, copies = _regroup(_layout([[0, 1, 2], [3, 4, 5]]), [0], "data_parallel", 12, 2)
    assert replicas == [[0], [1], [2], [3], [4], [5]]
    assert shards == [(0, 2)] * 3 + [(1, 2)] * 3 and parts == [(0, 3), (1, 3), (2, 3)] * 2
    assert copies == [(0, 1), (0, 2), (3, 4), (3, 5)]
    # released ranks that do not make a whole pipeline exit
    replicas, _, parts, copies = _regroup(_layout([[0, 1, 2]]), [0, 1], "data_parallel", 16)
    assert replicas == [[0, 1]] and parts == [(0, 1)] and copies == []
    # other release modes keep one replica per shard
    assert _regroup(_layout([[0, 1, 2, 3]]), [0, 1], "exit", 16)[0] == [[0, 1]]


def test_regroup_under_tensor_parallelism_keeps_every_stage_group_together():
    # P = 4 x T = 2 (ranks (p * 2 + t)) packed onto pipeline ranks 0 and 1: both tensor-parallel rows keep them
    layout = ReplicaLayout.even(8, 1, 2)
    new, copies = layout.regroup([0, 1], "exit", 16, 4)
    assert new.replicas == [[0, 2], [1, 3]] and new.tp_size == 2 and copies == []
    assert new.tp_ranks(1, 0) == [2, 3] and new.renumbered().tp_ranks(1, 0) == [1, 3]


def test_regroup_under_tensor_parallelism_makes_replicas_of_whole_stage_groups():
    # D = 2 x P = 2 x T = 2 packed onto pipeline rank 0: each replica's freed stage group (its two tensor-parallel
    # processes) becomes a new replica, process t copying process t of the kept stage
    layout = ReplicaLayout.even(8, 2, 2)
    assert layout.replicas == [[0, 2], [1, 3], [4, 6], [5, 7]]
    new, copies = layout.regroup([0], "data_parallel", 16, 4)
    assert new.replicas == [[0], [1], [2], [3], [4], [5], [6], [7]] and new.tp_size == 2 and new.dp_size == 4
    assert [new.tp_ranks(0, d) for d in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert new.shards == [(0, 2), (0, 2), (1, 2), (1, 2)] and new.parts == [(0, 2), (1, 2)] * 2
    assert copies == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert new.stage_ranks(0, 1) == [1, 3, 5, 7]  # the grown replica group of tensor-parallel rank 1


def test_regroup_only_splits_batches_into_whole_micro_batches():
    # 12 samples in 4 micro-batches: halves of 6 do not split into 4, so the released ranks exit instead
    with pytest.warns(UserWarning, match=r"does not split into 2 parts of whole micro-batches"):
        replicas, _, parts, _ = _regroup(_layout([[0, 1, 2, 3]]), [0, 1], "data_parallel", 12)
    assert replicas == [[0, 1]] and parts == [(0, 1)]
    # a replica that already takes half its shard's batch splits it further (parts compose)
    replicas, _, parts, _ = _regroup(_layout([[0, 1], [2, 3]], parts=[(0, 2), (1, 2)]), [0], "data_parallel", 16, 2)
    assert replicas == [[0], [1], [2], [3]] and parts == [(0, 4), (1, 4), (2, 4), (3, 4)]
