"""Automatic resumption: a restarted job finds the newest complete checkpoint of its run itself.

torchrun's elastic agent (``--max-restarts``) restarts every worker of the job when one fails or a node leaves, and
Slurm requeues a job that was preempted or lost a node; in both the same command runs again, usually without a
``ckpt_path``. A process started by a job manager (torchrun: ``TORCHELASTIC_RUN_ID``; Slurm: ``SLURM_JOB_ID``) or
told it was restarted (``TORCHELASTIC_RESTART_COUNT`` / ``SLURM_RESTART_COUNT`` above 0) looks for the newest
complete checkpoint in the run's checkpoint directories (every ``ModelCheckpoint``'s ``dirpath``, or where Lightning
would put it, every logger version included) and resumes from it, on whatever world the rendezvous gave: the
strategy re-derives the pipeline width from the world size and any checkpoint loads at any width
(docs/checkpoints.md). The restart count alone would not do: a replacement node joining an elastic job starts its
workers with a count of 0 while the survivors' are restarted, and all of a world's processes must resume alike; as
torchtitan does, a job under a job manager resumes from its checkpoint directory whenever it holds a checkpoint.

A checkpoint is complete when it is at its final name: sharded checkpoints are written to ``<name>.tmp-<id>`` and
renamed once their ``meta.pt`` is written (after every shard), single files are renamed once written
(``pipeline/checkpoint/sharded.py``, ``single_file.py``). A swap interrupted between its two renames leaves the
complete previous checkpoint at ``<name>.old``, which counts as ``<name>``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from dynmo_lightning.pipeline.checkpoint.sharded import META, complete_directory

log = logging.getLogger(__name__)

#: Environment variables in which a job manager counts the job's restarts (torchrun's elastic agent, Slurm requeue).
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


#: Variables a job manager sets in every process it starts (torchrun's elastic agent, Slurm).
MANAGED = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def managed(environ: dict[str, str] | None = None) -> bool:
    """Whether a job manager that restarts jobs started this process (torchrun's elastic agent, Slurm)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(k) for k in MANAGED)


def restart_count(environ: dict[str, str] | None = None) -> int:
    """How many times the job manager restarted this job (0: the first start, or no job manager counts)."""
    environ = os.environ if environ is None else environ
    counts = [environ.get(k, "").strip() for k in RESTART_COUNTS]
    return max([int(c) for c in counts if c.isdigit()], default=0)


def checkpoint_dirs(trainer: Any) -> list[Path]:
    """The directories where this run's checkpoints are: each ``ModelCheckpoint``'s, as Lightning resolves it.

    Without a ``dirpath``, Lightning puts checkpoints under the first logger's ``<save_dir>/<name>/<version>/`` and a
    restarted run gets a new version: every version's ``checkpoints`` is searched. Without loggers, it is
    ``<default_root_dir>/checkpoints``.
    """
    dirs: list[Path] = []
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath is not None:
            dirs.append(Path(callback.dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            base = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
            dirs += sorted(p for p in base.glob("*/checkpoints") if p.is_dir())
        else:
            dirs.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(dirs))


def newest_checkpoint(dirs: Iterable[str | os.PathLike[str]], suffix: str = ".ckpt") -> str | None:
    """The newest complete checkpoint (file or sharded directory named ``*<suffix>``) in ``dirs``, if any.

    Ties (``last.ckpt`` and ``step=30.ckpt`` written at the same step) go to the name that sorts last, so that every
    process picks the same one.
    """
    found: dict[Path, float] = {}
    for d in map(Path, dirs):
        if not d.is_dir():
            continue
        for entry in d.iterdir():
            name = entry.name.removesuffix(".old")  # a swap cut between its renames: the previous one, complete
            written = written_at(entry.with_name(name)) if name.endswith(suffix) else None
            if written is not None:
                found[entry.with_name(name)] = written
    if not found:
        return None
    return os.fspath(max(found, key=lambda p: (found[p], p.name)))


def written_at(path: str | os.PathLike[str]) -> float | None:
    """When the complete checkpoint at ``path`` was written (as loading finds it: a sharded one's ``.old`` counts)."""
    directory = complete_directory(path)
    if directory is not None:
        return (directory / META).stat().st_mtime
    path = Path(path)
    return path.stat().st_mtime if path.is_file() and path.stat().st_size > 0 else None


def resume_path(
    trainer: Any, given: str | os.PathLike[str] | None, restarts: int | None = None, manager: bool | None = None
) -> Any:
    """The checkpoint ``fit`` resumes from: ``given``, or the run's newest under a job manager (module docstring).

    Under a job manager (or on a restart), the newest complete checkpoint of the run's directories is taken when the
    user gave none, or gave one that is older (a restarted fine-tuning job goes on from its own last checkpoint, not
    from the one it started from). Lightning's own names (``"last"``, ``"hpc"``, ``"best"``, ``"registry"``) and
    URLs are left to Lightning. Without a job manager nothing changes.
    """
    restarts = restart_count() if restarts is None else restarts
    manager = managed() if manager is None else manager
    named = given is not None and (not isinstance(given, (str, os.PathLike)) or _named(given))
    if not (restarts or manager) or named:
        return given
    newest = newest_checkpoint(checkpoint_dirs(trainer))
    if newest is None:
        return given
    if given is not None:
        given_at, newest_at = written_at(given), written_at(newest)
        if given_at is not None and newest_at is not None and given_at >= newest_at:
            return given
    log.warning(
        "resuming from the run's newest complete checkpoint %s (restart %d of the job; strategy auto_resume=False, or "
        "an empty checkpoint directory, starts afresh)", newest, restarts,
    )  # fmt: skip
    return newest


def _named(path: str | os.PathLike[str]) -> bool:
    text = os.fspath(path)
    return text in ("last", "hpc", "best", "registry") or text.startswith("registry:") or "://" in text


#: Whether this process ran a ``fit`` already (only the first one resumes by itself).
_fitted = False


def with_resume_path(function: Callable[..., Any], args: tuple, kwargs: dict, trainer: Any) -> tuple[tuple, dict]:
    """``function``'s arguments (Lightning's ``_fit_impl``) with ``ckpt_path`` set by :func:`resume_path`.

    Only the process's first ``fit`` resumes (what a restarted process runs again; a second ``fit`` in the same
    process is the script's own next stage): validate, test, predict and later fits keep what they were given.
    """
    global _fitted
    signature = inspect.signature(function)
    if _fitted or getattr(function, "__name__", "") != "_fit_impl" or "ckpt_path" not in signature.parameters:
        return args, kwargs
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return args, kwargs
    _fitted = True
    bound.arguments["ckpt_path"] = resume_path(trainer, bound.arguments.get("ckpt_path"))
    return bound.args, bound.kwargs


def count_the_epoch_in_progress(checkpoint: dict[str, Any]) -> bool:
    """Mend the fit loop's epoch counters of a checkpoint written by a run resumed at an epoch's end (in place).

    Lightning (2.6) resuming from a checkpoint taken on the last batch of an epoch finishes that epoch in its
    ``reset`` and starts the next one as a "restarted mid-epoch" one: without counting it as ready and started (and
    without ``on_train_epoch_start``). Every checkpoint that run writes then says that the epoch in progress never
    started (``ready == started == processed == completed``), and resuming from it again sets the sampler to the
    finished epoch: the epoch's batches are the previous epoch's, and the job trains on other data than an
    uninterrupted one would. A checkpoint taken inside a training batch (its batch progress one short of completed)
    always has its epoch in progress: it is counted here as ready and started, as an uninterrupted run counts it.

    Returns:
        Whether the checkpoint was mended.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    if not epochs or not batches:
        return False
    total = epochs["total"]
    inside_a_batch = batches["total"]["completed"] == batches["total"]["ready"] - 1
    if not inside_a_batch or len({total["ready"], total["started"], total["processed"], total["completed"]}) != 1:
        return False
    for counts in (epochs["total"], epochs["current"]):
        counts["ready"] = counts["started"] = counts["completed"] + 1
    return True
