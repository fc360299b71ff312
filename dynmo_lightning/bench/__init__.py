"""``dynmo-bench``: where DynMo's speed-ups are real - measured, combined and simulated, every number kept in a file.

Five parts (Hydra config ``conf/bench/config.yaml``; ``parts=[...]`` picks some, ``resume=true`` keeps the files
already in the run directory, e.g. ``hydra.run.dir=docs/bench``):

1. ``layer_costs`` - single layers of an LLM-sized model (hidden 1024, sequence 1024; and 4096 for sparse attention)
   timed on this machine in every state of every dynamic (:mod:`.layer_costs`): ``layer_costs*.json``.
2. ``timelines`` - the reference GPT (62 blocks) trained with each dynamic as its paper runs it, at every strength
   of its sweep, recording every layer's state at every step and the validation loss (:mod:`.timeline`):
   ``timelines/<dynamic>-<strength>.json.gz``.
3. ``real`` - real A/B runs on this machine's ranks: uniform split against DynMo, alternated, repeated, with 95 %
   intervals and the ideal ratio of the same window (:mod:`.real`): ``real/*.json`` and ``real.json``.
4. ``scale`` - the timelines turned into realistic cost traces (``traces/<dynamic>.jsonl.gz``, the profiler's
   format) and replayed at 8, 16 and 32 stages with every policy and the oracle, with the link and migration
   bandwidth measured here, a migration-bandwidth sweep for clusters and the strength sweeps (:mod:`.scale`):
   ``simulated.json``.
5. ``report`` - ``benchmarks.md`` and the plots (:mod:`.page`), rebuilt from those files alone (``dynmo-report DIR``
   does the same), with the README's headline table and each dynamic's cost drift (:mod:`.drift`).

The console script and its Hydra configuration live in :mod:`.main` (``dynmo-bench``, ``python -m
dynmo_lightning.bench``): the package and its parts import without Hydra, as on a GPU machine that has only torch,
Lightning and transformers (``examples/gpu_check.py``). ``python -m dynmo_lightning.bench worker SPEC`` is one rank of
the real runs; ``... timeline DYNAMIC STRENGTH OUT`` records one timeline in its own process.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

#: Display names of the dynamics in tables and plots.
NAMES = {
    "none": "no dynamic",
    "freezing": "freezing",
    "pruning": "pruning",
    "early_exit": "early exit",
    "mod": "Mixture of Depths",
    "moe": "MoE",
    "sparse_attention": "sparse attention",
}


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON (gzip-compressed when the name ends with ``.gz``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(json.dumps(data, separators=(",", ":")))
    else:
        path.write_text(json.dumps(data, indent=1))


def read_json(path: Path) -> Any:
    """Read what :func:`write_json` wrote."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text())


def real_stem(schedule: str) -> str:
    """The name of the real part's results under ``schedule``: ``real`` for 1F1B, else ``real_<schedule>``."""
    return "real" if schedule == "1f1b" else f"real_{schedule}"


def timeline_path(directory: Path, dynamic: str, strength: float | None) -> Path:
    """Where a benchmark directory keeps the timeline of ``dynamic`` at ``strength`` (``None``: no dynamic)."""
    return directory / "timelines" / f"{dynamic}-{strength if strength is not None else 'none'}.json.gz"
