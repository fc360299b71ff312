"""Automatic resumption: a restarted job finds the newest complete checkpoint of its run itself.

torchrun's elastic agent (``--max-restarts``) restarts every worker of the job when one fails or a node leaves, and
Slurm requeues a job that was preempted or lost a node; in both the same command runs again, usually without a
``ckpt_path``. Workers that know they were restarted (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT``
above 0) look for the newest complete checkpoint in the run's checkpoint directories (every ``ModelCheckpoint``'s
``dirpath``, or where Lightning would put it, every logger version included) and resume from it, on whatever world
the rendezvous gave: the strategy re-derives the pipeline width from the world size and any checkpoint loads at any
width (docs/checkpoints.md).

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

from dynmo_lightning.pipeline.checkpoint.sharded import META

log = logging.getLogger(__name__)

#: Environment variables in which a job manager counts the job's restarts (torchrun's elastic agent, Slurm requeue).
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


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


def _complete(path: Path) -> float | None:
    """When the complete checkpoint at ``path`` was written (its modification time), or ``None`` if none is."""
    meta = path / META
    if meta.is_file():
        return meta.stat().st_mtime
    if path.is_file() and path.stat().st_size > 0:
        return path.stat().st_mtime
    return None


def newest_checkpoint(dirs: Iterable[str | os.PathLike[str]], suffix: str = ".ckpt") -> str | None:
    """The newest complete checkpoint (file or sharded directory named ``*<suffix>``) in ``dirs``, if any.

    Ties (``last.ckpt`` and ``step=30.ckpt`` written at the same step) go to the name that sorts last, so that every
    process picks the same one.
    """
    found: dict[Path, float] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for entry in d.iterdir():
            name = entry.name
            if name.endswith(suffix + ".old"):  # a swap interrupted between its renames: the previous, complete
                target = entry.with_name(name[: -len(".old")])
                written = None if target.exists() or not (entry / META).is_file() else _complete(entry)
                entry = target
            else:
                written = _complete(entry) if name.endswith(suffix) else None
            if written is not None:
                found[entry] = max(written, found.get(entry, written))
    if not found:
        return None
    return os.fspath(max(found, key=lambda p: (found[p], p.name)))


def written_at(path: str | os.PathLike[str]) -> float | None:
    """When the checkpoint at ``path`` was written, if it is complete (its ``.old`` counts, as loading reads it)."""
    path = Path(path)
    written = _complete(path)
    return written if written is not None else _complete(Path(os.fspath(path) + ".old"))


def resume_path(trainer: Any, given: str | os.PathLike[str] | None, restarts: int | None = None) -> Any:
    """The checkpoint a (re)started ``fit`` resumes from: ``given``, or the run's newest if the job was restarted.

    On a restart, the newest complete checkpoint of the run's directories is taken when the user gave none, or gave
    one that is older (a restarted fine-tuning job goes on from its own last checkpoint, not from the one it started
    from). Lightning's own names (``"last"``, ``"hpc"``, ``"best"``, ``"registry"``) and URLs are left to Lightning.
    """
    restarts = restart_count() if restarts is None else restarts
    if restarts == 0 or (given is not None and (not isinstance(given, (str, os.PathLike)) or _named(given))):
        return given
    newest = newest_checkpoint(checkpoint_dirs(trainer))
    if newest is None:
        log.info("restart %d of the job: no complete checkpoint in the run's directories, starting afresh", restarts)
        return given
    if given is not None:
        given_at, newest_at = written_at(given), written_at(newest)
        if given_at is not None and newest_at is not None and given_at >= newest_at:
            return given
    log.warning("restart %d of the job: resuming from the newest complete checkpoint %s", restarts, newest)
    return newest


def _named(path: str | os.PathLike[str]) -> bool:
    text = os.fspath(path)
    return text in ("last", "hpc", "best", "registry") or text.startswith("registry:") or "://" in text


def with_resume_path(function: Callable[..., Any], args: tuple, kwargs: dict, trainer: Any) -> tuple[tuple, dict]:
    """``function``'s arguments (Lightning's ``_fit_impl``) with ``ckpt_path`` set by :func:`resume_path`.

    Only ``fit`` resumes: validate, test and predict keep the checkpoint they were given.
    """
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except TypeError:
        return args, kwargs
    if getattr(function, "__name__", "") != "_fit_impl" or "ckpt_path" not in inspect.signature(function).parameters:
        return args, kwargs
    bound.arguments["ckpt_path"] = resume_path(trainer, bound.arguments.get("ckpt_path"))
    return bound.args, bound.kwargs
