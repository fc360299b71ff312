"""Cost traces: per-step, per-layer costs as the runtime profiler writes them to ``costs.jsonl``.

One JSON object per line and step: ``{"step": int, "fwd": [...], "bwd": [...], "param_bytes": [...]}``, with
``param_bytes`` (and further per-layer fields such as ``optim_bytes``) optional. Forward and backward times are per
micro-batch, one entry per layer.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_lightning.balance.split.checks import as_values

Trace = list[dict[str, Any]]


#: Fields of a trace step that are lists but not one entry per layer: the partition in force (one entry per stage)
#: and the layers a dynamic changed just before the step (the balancer's events).
PER_STAGE = frozenset({"layers_per_stage", "changed_layers"})


def check_trace(trace: Iterable[Mapping[str, Any]]) -> Trace:
    """Validate a trace and normalise it to plain dictionaries of float lists.

    Args:
        trace: steps in order; each needs ``fwd`` and ``bwd`` lists of one length shared by all steps; ``step``
            defaults to the position in the trace; other per-layer lists (``param_bytes``, ``optim_bytes``) must
            have that length too.

    Returns:
        The steps as new dictionaries (``step`` an ``int``, per-layer fields lists of ``float``).

    Raises:
        ValueError: for an empty trace, a missing ``fwd``/``bwd``, negative or non-finite entries, or lengths that
            differ between fields or steps.
    """
    steps: Trace = []
    n_layers = None
    for index, entry in enumerate(trace):
        missing = {"fwd", "bwd"} - set(entry)
        if missing:
            raise ValueError(f"trace step {index} lacks {sorted(missing)}: every step needs 'fwd' and 'bwd' lists")
        out: dict[str, Any] = {"step": int(entry.get("step", index))}
        for key, value in entry.items():
            if key == "step":
                continue
            if key in PER_STAGE or not isinstance(value, (Sequence, np.ndarray)) or isinstance(value, str):
                out[key] = value  # per-step scalars and per-stage lists (the partition in force) ride along untouched
                continue
            values = as_values(value, f"trace step {index} {key}").tolist()
            if not values:
                raise ValueError(f"trace step {index} has no '{key}' entries: give one entry per layer")
            if n_layers is None:
                n_layers = len(values)
            if len(values) != n_layers:
                raise ValueError(
                    f"trace step {index} has {len(values)} '{key}' entries but {n_layers} layers: "
                    "give one entry per layer in every per-layer field and step"
                )
            out[key] = values
        steps.append(out)
    if not steps:
        raise ValueError("the trace has no steps: give at least one step")
    return steps


def _open(path: str | os.PathLike[str], mode: str) -> Any:
    """The file, through gzip when its name ends with ``.gz`` (committed traces are compressed)."""
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a ``costs.jsonl`` trace, or a gzip-compressed ``.jsonl.gz`` one (blank lines are skipped).

    Args:
        path: the file.

    Returns:
        The validated steps (see :func:`check_trace`).

    Raises:
        ValueError: for a line that is not a JSON object, or as :func:`check_trace`.
    """
    steps = []
    with _open(path, "r") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError(f"{path}:{number} is not a JSON object")
            steps.append(entry)
    return check_trace(steps)


def save_trace(trace: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write a trace as ``costs.jsonl``, one step per line (gzip-compressed when ``path`` ends with ``.gz``).

    Args:
        trace: the steps (validated first, see :func:`check_trace`).
        path: the file to (over)write; its directory is created if missing.
    """
    steps = check_trace(trace)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "w") as handle:
        for entry in steps:
            handle.write(json.dumps(entry) + "\n")
