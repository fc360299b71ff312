"""What ``examples/bench_data_parallel.py`` measured, as ``docs/scale_out.md`` shows it: one row per way of sharing.

The benchmark writes ``docs/bench/data_parallel.json``; :func:`table` renders its rows (tokens/s, the ratio to ddp,
every process's measured step peak beside the memory model's prediction), and ``tests/bench/test_data_parallel.py``
holds the page to the file and the file to the claims made of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynmo_lightning.plots import TIMES

#: The ways a stage's replicas share its layers, in the order the page lists them (the file's keys).
MODES = ("ddp", "replicate", "fsdp", "fsdp_memory=lean")


def table(report: Mapping[str, Any]) -> str:
    """The Markdown table of a ``data_parallel.json`` report."""
    rows = [
        "| way (`data_parallel`, setting) | tokens/s | over ddp | step peak, every process (MiB) | over ddp | "
        "memory model's prediction, error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES:
        r = report["modes"][mode]
        peaks, errors, vs_ddp = r["step_peak_bytes"], r["prediction_error"], r["step_peak_vs_ddp"]
        rows.append(
            f"| `{mode}` | {r['mean']:.1f} [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}] | {r['ratio_to_ddp']:.2f}{TIMES} "
            f"[{r['ratio_ci95'][0]:.2f}, {r['ratio_ci95'][1]:.2f}] | {_span([p / 2**20 for p in peaks], '.0f')} | "
            f"{_span(vs_ddp, '.2f')}{TIMES} | {_span([100 * e for e in errors], '+.1f')} % |"
        )
    return "\n".join(rows)


def _span(values: list[float], spec: str) -> str:
    low, high = min(values), max(values)
    return f"{low:{spec}}" if f"{low:{spec}}" == f"{high:{spec}}" else f"{low:{spec}} to {high:{spec}}"
