"""Consolidation and released processes as replicas with layers held in parts (FSDP2, replicate, tensor parallel).

The world changes under layers held as DTensors: a repack moves them (as their parts) onto fewer processes, the
world restarts, and every layer is made parts again on the new meshes (``pipeline/reshape.rehome``): around the same
local parts where a process keeps its place, re-sharded over the grown replica group where released processes
become replicas. Against the pipeline that never repacks (fp32, relative <= 1e-5 per step, the final model): P = 4
``fsdp`` (one replica) consolidating onto 2 with the released processes exiting, and growing a second replica from
them under ``fsdp`` (every layer re-sharded from 1 to 2 replicas) and ``replicate``; P = 4 x T = 2 (8 processes)
consolidating onto P = 2 x T = 2. Memory: during a consolidation whose released processes become FSDP2 replicas, no
process holds more than its parts, what it received, and one layer whole (with its optimizer state).
"""

from __future__ import annotations

import json

import pytest
from support import SUPPORT
from support.helpers import (
    FREEZE,
    REPACK,
    assert_close_losses,
    assert_close_model,
    assert_close_params,
    launch,
    launch_script,
    slow,
)

STEPS = ["trainer.max_steps=20"]
#: Released processes become replicas; no re-partition within a pipeline (only the repack changes the split).
AS_REPLICAS = ["balancer.on_release=data_parallel", "balancer.min_gain=1.0"]
CASES = {
    "fsdp-exit": (4, ["strategy.data_parallel=fsdp"]),
    "fsdp-replicas": (4, ["strategy.data_parallel=fsdp", *AS_REPLICAS]),
    "replicate-replicas": (4, ["strategy.data_parallel=replicate", *AS_REPLICAS]),
    "tp2-exit": (8, ["strategy.tensor_parallel_size=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic_in_parts")
    out = launch(2, {d / "pp2": [*FREEZE, *STEPS]})
    for name, (world, settings) in CASES.items():  # one launch each: released processes leave after a repack
        out |= launch(world, {d / name: [*FREEZE, *REPACK, *STEPS, *settings]}, inject_costs=True)
    return {path.name: run for path, run in out.items()}


@slow
@pytest.mark.parametrize("name", list(CASES))
def test_consolidation_of_layers_held_in_parts_keeps_the_math(runs, name):
    ref, run = runs["pp2"], runs[name]
    world, settings = CASES[name]
    sizes = run.summary["world_size"]
    assert sizes[0]["world_size"] == world and [len(p["layers_per_stage"]) for p in run.summary["partitions"]] == [
        4,
        2,
    ]
    if "balancer.on_release=data_parallel" in settings:
        assert sizes[-1] == {"step": sizes[-1]["step"], "world_size": 4, "replicas": 2}
        assert run.summary["replicas_in_sync"]
    else:
        assert sizes[-1]["world_size"] == world // 2
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"], rtol=1e-4)


@slow
def test_a_world_change_holds_a_process_parts_and_one_layer_whole(tmp_path):
    launch_script(4, SUPPORT / "_world_change_memory_script.py", str(tmp_path / "out"), log_dir=tmp_path / "logs")
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(4)]
    for rank in ranks:
        assert rank["replicas"] == 2  # the released ranks became a second replica
        # its parts before (gradients are dropped before layers move), what arrived (parts of moved layers, copies),
        # and one layer whole with its AdamW state while it is re-sharded over the grown group: never two layers
        # whole, never the stage
        bound = rank["before"] - rank["grads"] + rank["received"] + rank["layer_bytes"]
        assert rank["peak"] <= 1.02 * bound, rank
        assert rank["after"] < rank["before"] + rank["received"], rank  # re-sharded: half of every layer kept


@slow
def test_fsdp_shrinks_and_grows_back_with_the_math(tmp_path):
    """P = 4 ``fsdp`` -> 2 while the load fits on two, back to 4 when it rises (injected at step 12): the units are
    made again over every new world's groups, and the re-admitted processes receive layers as their shards."""
    model = ["model.n_layer=6", "strategy.n_microbatches=8"]  # 8 layers: four stages beat three once all cost
    elastic = [*REPACK, "balancer.repack_tolerance=0.15", "balancer.on_release=wait", "strategy.data_parallel=fsdp"]
    runs = launch(
        4,
        {tmp_path / "static": [*model, "trainer.max_steps=30"], tmp_path / "grow": [*model, *elastic,
                                                                                   "trainer.max_steps=30"]},
        inject_costs=True,
        load_rises_at=12,
    )  # fmt: skip
    static, grown = runs[tmp_path / "static"], runs[tmp_path / "grow"]
    assert [w["world_size"] for w in grown.summary["world_size"]] == [4, 2, 4], grown.summary["world_size"]
    assert_close_losses(grown.summary["losses"], static.summary["losses"])
    assert_close_model(grown.checkpoint["state_dict"], static.checkpoint["state_dict"])
