"""A restarted job finds the newest complete checkpoint of its run (``pipeline/checkpoint/resume.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from dynmo_lightning.pipeline.checkpoint import resume
from dynmo_lightning.pipeline.checkpoint.sharded import META


def _sharded(path: Path, when: float) -> Path:
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    (path / META).write_bytes(b"meta")
    os.utime(path / META, (when, when))
    return path


def _single(path: Path, when: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"checkpoint")
    os.utime(path, (when, when))
    return path


def test_restart_count_reads_torchrun_and_slurm():
    assert resume.restart_count({}) == 0
    assert resume.restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert resume.restart_count({"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "0"}) == 1
    assert resume.restart_count({"SLURM_RESTART_COUNT": ""}) == 0


def test_newest_complete_checkpoint_wins_and_partial_ones_never(tmp_path):
    now = time.time()
    _single(tmp_path / "a" / "epoch=0-step=10.ckpt", now - 30)
    _sharded(tmp_path / "b" / "epoch=0-step=20.ckpt", now - 20)
    # newer but incomplete: a sharded directory still at its temporary name, one without its meta.pt, an empty file
    _sharded(tmp_path / "b" / "epoch=0-step=30.ckpt.tmp-1234", now)
    (tmp_path / "b" / "epoch=0-step=40.ckpt").mkdir()
    _single(tmp_path / "a" / "epoch=0-step=50.ckpt", now).write_bytes(b"")
    (tmp_path / "a" / "notes.txt").write_text("not a checkpoint")
    assert resume.newest_checkpoint([tmp_path / "a", tmp_path / "b", tmp_path / "missing"]) == os.fspath(
        tmp_path / "b" / "epoch=0-step=20.ckpt"
    )
    assert resume.newest_checkpoint([tmp_path / "missing"]) is None


def test_a_swap_interrupted_between_its_renames_resumes_from_the_old_one(tmp_path):
    now = time.time()
    _single(tmp_path / "epoch=0-step=10.ckpt", now - 30)
    _sharded(tmp_path / "last.ckpt.old", now - 10)  # last.ckpt itself is gone: the swap was cut between renames
    assert resume.newest_checkpoint([tmp_path]) == os.fspath(tmp_path / "last.ckpt")
    assert resume.written_at(tmp_path / "last.ckpt") == pytest.approx(now - 10)


def test_same_time_ties_go_to_one_name_on_every_process(tmp_path):
    now = time.time()
    _single(tmp_path / "epoch=0-step=30.ckpt", now)
    _single(tmp_path / "last.ckpt", now)
    assert resume.newest_checkpoint([tmp_path]) == os.fspath(tmp_path / "last.ckpt")


def _trainer(tmp_path: Path, callbacks: list, loggers: list | None = None) -> SimpleNamespace:
    return SimpleNamespace(callbacks=callbacks, loggers=loggers or [], default_root_dir=os.fspath(tmp_path))


def test_checkpoint_dirs_are_where_lightning_writes_every_version_included(tmp_path):
    logger = SimpleNamespace(save_dir=os.fspath(tmp_path / "logs"), name="run", version=2)
    for version in ("version_0", "version_1"):
        (tmp_path / "logs" / "run" / version / "checkpoints").mkdir(parents=True)
    explicit = ModelCheckpoint(dirpath=tmp_path / "mine")
    dirs = resume.checkpoint_dirs(_trainer(tmp_path, [explicit, ModelCheckpoint()], [logger]))
    versions = [tmp_path / "logs" / "run" / v / "checkpoints" for v in ("version_0", "version_1")]
    assert dirs == [tmp_path / "mine", *versions]
    assert resume.checkpoint_dirs(_trainer(tmp_path, [ModelCheckpoint()])) == [tmp_path / "checkpoints"]


def test_resume_path_under_a_job_manager_and_never_older_than_given(tmp_path):
    now = time.time()
    newest = _single(tmp_path / "checkpoints" / "last.ckpt", now - 5)
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path / "checkpoints")])
    assert resume.resume_path(trainer, None, restarts=0, manager=False) is None  # no job manager: as the user said
    assert resume.resume_path(trainer, None, restarts=1, manager=False) == os.fspath(newest)
    # torchrun / Slurm: a replacement node's workers start with a restart count of 0 and must resume as the others
    assert resume.resume_path(trainer, None, restarts=0, manager=True) == os.fspath(newest)
    older = _single(tmp_path / "pretrained.ckpt", now - 100)
    assert resume.resume_path(trainer, older, restarts=1, manager=True) == os.fspath(newest)  # the run's own progress
    newer = _single(tmp_path / "given.ckpt", now)
    assert resume.resume_path(trainer, newer, restarts=1, manager=True) == newer
    for named in ("last", "hpc", "s3://bucket/x.ckpt"):
        assert resume.resume_path(trainer, named, restarts=1, manager=True) == named  # Lightning's own names
    empty = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path / "nothing-yet")])
    assert resume.resume_path(empty, None, restarts=0, manager=True) is None  # a first start: afresh


def test_job_managers_are_recognised():
    assert resume.managed({"TORCHELASTIC_RUN_ID": "job"}) and resume.managed({"SLURM_JOB_ID": "42"})
    assert not resume.managed({}) and not resume.managed({"SLURM_JOB_ID": ""})


def test_with_resume_path_fills_the_first_fit_only(tmp_path, monkeypatch):
    newest = _single(tmp_path / "checkpoints" / "last.ckpt", time.time())
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=tmp_path / "checkpoints")])

    def _fit_impl(model, train_dataloaders=None, val_dataloaders=None, datamodule=None, ckpt_path=None):
        return ckpt_path

    def _validate_impl(model, dataloaders=None, ckpt_path=None):
        return ckpt_path

    for key in resume.MANAGED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(resume, "_fitted", False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    args, kwargs = resume.with_resume_path(_fit_impl, ("model",), {}, trainer)
    assert _fit_impl(*args, **kwargs) is None  # neither restarted nor under a job manager
    monkeypatch.setattr(resume, "_fitted", False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args, kwargs = resume.with_resume_path(_validate_impl, ("model",), {}, trainer)
    assert _validate_impl(*args, **kwargs) is None
    args, kwargs = resume.with_resume_path(_fit_impl, ("model", None, None, "data", None), {}, trainer)
    assert _fit_impl(*args, **kwargs) == os.fspath(newest)
    args, kwargs = resume.with_resume_path(_fit_impl, ("model",), {}, trainer)
    assert _fit_impl(*args, **kwargs) is None  # the process's second fit is the script's own


def _loops(epochs: tuple[int, int, int, int], batches: tuple[int, int], last: bool) -> dict:
    ready, started, processed, completed = epochs
    counts = {"ready": ready, "started": started, "processed": processed, "completed": completed}
    batch = {"ready": batches[0], "completed": batches[1], "started": batches[0], "processed": batches[0]}
    fit = {"epoch_progress": {"total": dict(counts), "current": dict(counts)},
           "epoch_loop.batch_progress": {"total": batch, "current": dict(batch), "is_last_batch": last}}  # fmt: skip
    return {"loops": {"fit_loop": fit}}


def test_the_epoch_a_resumed_run_never_counted_is_counted():
    # Lightning's count in a run resumed at an epoch's end, on the last batch of epoch 4: epoch 4 never "started"
    lagged = _loops((4, 4, 4, 4), (50, 49), last=True)
    assert resume.count_the_epoch_in_progress(lagged)
    assert lagged == _loops((5, 5, 4, 4), (50, 49), last=True)  # what an uninterrupted run writes there
    mid_epoch = _loops((3, 3, 3, 3), (35, 34), last=False)
    assert resume.count_the_epoch_in_progress(mid_epoch)
    assert mid_epoch == _loops((4, 4, 3, 3), (35, 34), last=False)


@pytest.mark.parametrize(
    "state",
    [
        _loops((5, 5, 4, 4), (50, 49), last=True),  # uninterrupted, last batch of epoch 4
        _loops((4, 4, 3, 3), (35, 34), last=False),  # uninterrupted, inside epoch 3
        _loops((5, 5, 5, 5), (50, 50), last=True),  # after fit: every epoch done, no batch in progress
        _loops((5, 5, 5, 4), (50, 50), last=True),  # on_train_epoch_end (every_n_epochs)
        {"state_dict": {}},  # a checkpoint without loops (weights only)
    ],
)
def test_counts_lightning_wrote_right_are_left_alone(state):
    before = repr(state)
    assert not resume.count_the_epoch_in_progress(state)
    assert repr(state) == before


def test_num_nodes_follow_the_world_torchrun_gave(monkeypatch):
    from dynmo_lightning.launch import torchrun_num_nodes

    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_num_nodes(3) == 3  # not under torchrun: as configured
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert torchrun_num_nodes(2) == 1  # restarted on one of two nodes
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert torchrun_num_nodes(1) == 4
