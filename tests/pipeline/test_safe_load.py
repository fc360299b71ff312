"""Loading a checkpoint never runs code from it: a crafted ``meta.pt``, ``.metadata`` or shard entry in an otherwise
valid sharded checkpoint (and a crafted single file) is refused, naming the file and what it asked for, by resume,
``load_whole`` and ``dynmo-export``; torch's own readers would have run the payload (shown here, so the tests can
fail); every legitimate checkpoint of the suite still loads (the other checkpoint tests)."""

from __future__ import annotations

import builtins
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.helpers import launch

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.launch import clean_env
from dynmo_lightning.pipeline.checkpoint import safe_load, sharded


class Payload:
    """Unpickling this runs ``exec`` of code that creates ``marker``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real sharded checkpoint of a 2-stage run."""
    d = tmp_path_factory.mktemp("safe")
    launch(2, {d / "run": ["trainer.max_steps=2", "checkpoint.every_n_train_steps=2"]})
    return d / "run" / "checkpoints" / "last.ckpt"


def _crafted_meta(saved: Path, dest: Path, marker: Path) -> Path:
    shutil.copytree(saved, dest)
    meta = torch.load(dest / sharded.META, weights_only=True)
    meta["loops"]["note"] = Payload(marker)
    torch.save(meta, dest / sharded.META)
    return dest


def _crafted_metadata(saved: Path, dest: Path, marker: Path) -> Path:
    shutil.copytree(saved, dest)
    metadata = safe_load.read_dcp_metadata(dest)
    metadata.storage_meta.modules = [Payload(marker)]  # type: ignore[list-item]
    with open(dest / safe_load.DCP_METADATA, "wb") as f:
        pickle.dump(metadata, f)
    return dest


CRAFTS = {"meta.pt": (_crafted_meta, "exec`"), ".metadata": (_crafted_metadata, "`builtins.exec`")}


@pytest.mark.timeout(300)
def test_torch_alone_would_run_the_payload(saved, tmp_path):
    """What the refusals below guard against: torch's plain readers run the crafted files."""
    marker = tmp_path / "ran"
    torch.load(_crafted_meta(saved, tmp_path / "a", marker) / sharded.META, weights_only=False)
    assert marker.exists()
    marker.unlink()
    dcp.FileSystemReader(_crafted_metadata(saved, tmp_path / "b", marker)).read_metadata()
    assert marker.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", sorted(CRAFTS))
def test_load_whole_refuses_a_crafted_part(saved, tmp_path, part):
    craft, refused = CRAFTS[part]
    marker = tmp_path / "ran"
    ckpt = craft(saved, tmp_path / "ckpt", marker)
    with pytest.raises(safe_load.CheckpointRefused) as info:
        sharded.load_whole(ckpt)
    assert str(ckpt / part) in str(info.value) and refused in str(info.value)
    assert "nothing of the file ran" in str(info.value)
    assert not marker.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", sorted(CRAFTS))
def test_dynmo_export_refuses_a_crafted_part(saved, tmp_path, part):
    craft, refused = CRAFTS[part]
    marker = tmp_path / "ran"
    ckpt = craft(saved, tmp_path / "ckpt", marker)
    exe = os.path.join(os.path.dirname(sys.executable), "dynmo-export")
    for extra in ([], ["--hf"]):
        proc = subprocess.run(
            [exe, str(ckpt), str(tmp_path / "out"), *extra], env=clean_env(), capture_output=True, text=True
        )
        assert proc.returncode != 0 and f"refused to load {ckpt / part}" in proc.stderr, proc.stderr[-2000:]
        assert refused in proc.stderr and not (tmp_path / "out").exists()
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_refuses_a_crafted_checkpoint(saved, tmp_path):
    marker = tmp_path / "ran"
    single = tmp_path / "single.ckpt"
    whole = sharded.load_whole(saved)
    whole["callbacks"]["note"] = Payload(marker)
    torch.save(whole, single)
    cases = {
        "meta.pt": (_crafted_meta(saved, tmp_path / "a", marker), tmp_path / "a" / sharded.META),
        ".metadata": (_crafted_metadata(saved, tmp_path / "b", marker), tmp_path / "b" / safe_load.DCP_METADATA),
        "single": (single, single),
    }
    for name, (ckpt, named) in cases.items():
        with pytest.raises(AssertionError) as info:  # the run fails: its log says why
            launch(1, {tmp_path / f"resume-{name}": ["trainer.max_steps=4", f"ckpt_path={ckpt}"]})
        assert f"refused to load {named}" in str(info.value), str(info.value)[-3000:]
        assert "exec`" in str(info.value)
    assert not marker.exists()


def test_a_crafted_shard_entry_is_refused(tmp_path):
    """Non-tensor entries of the shards: torch's planner loads them with weights_only=False, ours refuses."""
    marker = tmp_path / "ran"
    dcp.save({"model": {"w": torch.ones(3), "extra": Payload(marker)}}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert not marker.exists()
    template = {"model": {"w": torch.empty(3), "extra": None}}
    with pytest.raises(safe_load.CheckpointRefused, match=r"entry model\.extra.*exec`"):
        sharded._load_shards(template, str(tmp_path / "c"), no_dist=True)
    assert not marker.exists()
    plain = {"model": {"w": torch.empty(3), "extra": None}}
    dcp.load(plain, checkpoint_id=tmp_path / "c", no_dist=True)
    assert marker.exists()  # what torch alone does


def test_a_truncated_metadata_file_is_named(tmp_path):
    (tmp_path / safe_load.DCP_METADATA).write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(safe_load.CheckpointRefused, match=r"refused to load .*\.metadata: it asks for unreadable"):
        safe_load.read_dcp_metadata(tmp_path)


def test_weights_only_false_is_refused():
    with pytest.raises(ValueError, match=r"weights_only=False: DynMoStrategy loads every checkpoint with weights_only"):
        DynMoStrategy().load_checkpoint("any.ckpt", weights_only=False)
