"""Sharded checkpoints (torch.distributed.checkpoint): written at P=4 by every stage, resumed at P=2, 1, 3 and
DP=2 x PP=2 exactly as the single-file checkpoint resumes; each rank writes and reads only its own layers; the
export is a plain state_dict; an interrupted save leaves the last complete checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from support.helpers import DP2, TINY, assert_close_losses, assert_close_params, launch

from dynmo_lightning.cli import CONF_DIR
from dynmo_lightning.launch import clean_env
from dynmo_lightning.pipeline.checkpoint import sharded

EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]
# Layers move (a random split every 3 steps) and the first two freeze: the saved partition is nobody's default.
FREEZE = ["dynamics=freezing", "dynamics.mode=schedule", "dynamics.schedule={0:4,1:4}", "dynamics.start_step=0"]
MOVING = [*FREEZE, "balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    out = launch(
        4,
        {
            d / "sharded": [*MOVING, *EPOCH, "trainer.max_steps=10"],
            d / "single": [*MOVING, *EPOCH, "trainer.max_steps=10", "checkpoint.format=single"],
        },
    )

    def resume(name: str, *extra: str) -> list[str]:
        return [*FREEZE, *EPOCH, "trainer.max_steps=12", f"ckpt_path={d / name / 'checkpoints' / 'last.ckpt'}", *extra]

    out |= launch(2, {d / "p2": resume("sharded"), d / "p2-single": resume("single")})
    out |= launch(1, {d / "p1": resume("sharded")})
    out |= launch(3, {d / "p3": resume("sharded")})
    out |= launch(4, {d / "dp2": resume("sharded", *DP2)})
    return {path.name: run for path, run in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_checkpoint_is_a_directory_of_shards(runs):
    last = runs["sharded"].run_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and (last / sharded.META).is_file() and (last / ".metadata").is_file()
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert (runs["single"].run_dir / "checkpoints" / "last.ckpt").is_file()
    assert not list(last.parent.glob("*.tmp-*")) and not list(last.parent.glob("*.old"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["p2", "p1", "p3", "dp2"])
def test_resume_at_any_width_equals_resuming_the_single_file(runs, name):
    ref, resumed = runs["p2-single"], runs[name]
    assert_close_losses(resumed.summary["losses"], ref.summary["losses"], rtol=1e-6)
    assert_close_params(resumed.checkpoint["state_dict"], ref.checkpoint["state_dict"], rtol=1e-6)
    optim = resumed.checkpoint["optimizer_states"][0]
    assert optim["state"].keys() == ref.checkpoint["optimizer_states"][0]["state"].keys()
    assert resumed.checkpoint["callbacks"]["LayerFreezing"]["frozen"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_rank_writes_and_reads_only_its_own_layers(runs):
    whole = sharded.load_whole(runs["sharded"].run_dir / "checkpoints" / "last.ckpt")
    split = whole["dynmo"]["partitions"][-1]["layers_per_stage"]
    assert len(split) == 4
    nbytes, ntensors = _bytes_per_stage(whole, split), _bytes_per_stage(whole, split, count=True)
    last = runs["sharded"].run_dir / "checkpoints" / "last.ckpt"
    for rank, expected in enumerate(nbytes):
        written = (last / f"__{rank}_0.distcp").stat().st_size
        # its own tensors' bytes, plus a serialisation header per tensor (under 2 kB), and nothing of other stages
        assert expected <= written <= expected + 2048 * ntensors[rank] < sum(nbytes), (rank, written, expected)
    # what every process of the resumed runs read (recorded by the test worker): its own layers' bytes only
    for name, world in (("p2", 2), ("p3", 3), ("p1", 1)):
        run = runs[name]
        reads = _reads(run, world)
        start = run.summary["partitions"][0]["layers_per_stage"]
        assert len(start) == world
        for rank, expected in enumerate(_bytes_per_stage(whole, start)):
            assert expected <= reads[rank] <= expected + 2048 * sum(ntensors), (name, rank, reads[rank], expected)


def _reads(run, world: int) -> list[int]:
    """Bytes each rank read from the shards while resuming (``DYNMO_TEST_RECORD_READS`` of tests/support/_worker.py)."""
    return [json.loads((run.run_dir / f"reads.rank{r}.json").read_text())["bytes"] for r in range(world)]


def _bytes_per_stage(whole: dict, split: list[int], count: bool = False) -> list[int]:
    """Tensor bytes (parameters, buffers, optimizer state) of each stage's layers in a whole checkpoint.

    ``count``: the number of tensors instead.
    """
    layer_of = _layer_of_key(list(whole["state_dict"]))
    totals = [0] * len(split)
    bounds = [sum(split[:s]) for s in range(len(split) + 1)]
    stage_of = {i: s for s in range(len(split)) for i in range(bounds[s], bounds[s + 1])}
    for key, t in whole["state_dict"].items():
        totals[stage_of[layer_of[key]]] += 1 if count else t.numel() * t.element_size()
    for name, state in whole["optimizer_states"][0]["state"].items():
        for v in state.values():
            if torch.is_tensor(v):
                totals[stage_of[layer_of[name]]] += 1 if count else v.numel() * v.element_size()
    return totals


def _layer_of_key(keys: list[str]) -> dict[str, int]:
    """The pipeline layer of every state key of the tiny GPT: embedding, blocks 0..3, head."""
    out = {}
    for k in keys:
        if k.startswith("embed."):
            out[k] = 0
        elif k.startswith("blocks."):
            out[k] = 1 + int(k.split(".")[1])
        else:
            out[k] = 5
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_is_a_plain_state_dict(runs, tmp_path):
    out = tmp_path / "model.pt"
    ckpt = runs["sharded"].run_dir / "checkpoints" / "last.ckpt"
    cmd = [_export_exe(), str(ckpt), str(out)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(out, map_location="cpu", weights_only=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=TINY)
    model = instantiate(cfg.model, _convert_="all")
    model.configure_model()  # the layers are made here (on the meta device under the strategy)
    model.load_state_dict(state, strict=True)
    single = torch.load(runs["single"].run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert_close_params(state, single["state_dict"], rtol=1e-6)


def _export_exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "dynmo-export")


def test_an_interrupted_save_leaves_the_last_complete_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / sharded.META).write_bytes(b"complete")
    partial = tmp_path / "last.ckpt.tmp-abc"
    partial.mkdir()  # a save that died before it was complete never reaches the target
    assert (target / sharded.META).read_bytes() == b"complete" and sharded.is_sharded(target)
    # the swap itself: between its two renames the complete checkpoint is at <path>.old, and is found there
    os.replace(target, tmp_path / "last.ckpt.old")
    assert sharded.is_sharded(target)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / sharded.META).write_bytes(b"new")
    os.replace(tmp_path / "last.ckpt.old", target)
    sharded._replace(str(tmp_path / "new"), str(target))
    assert (target / sharded.META).read_bytes() == b"new" and not (tmp_path / "last.ckpt.old").exists()


def test_bad_format_is_refused():
    from dynmo_lightning import DynMoStrategy

    with pytest.raises(ValueError, match=r"checkpoint.format='zip' is not one of \['auto', 'sharded', 'single'\]"):
        DynMoStrategy(checkpoint_format="zip")
