"""Plots of training runs and benchmarks: the ``dynmo-report`` console script.

* :func:`plot_run` - a ``dynmo-train`` run directory: loss curve, per-stage load and imbalance (from
  ``costs.jsonl``), partition timeline and world size (from ``summary.json``).
* :func:`main` - ``dynmo-report DIR``: a run directory, or a ``dynmo-bench`` directory, whose ``benchmarks.md`` and
  plots :func:`dynmo_lightning.bench.page.report_bench` rebuilds from its files.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes

from dynmo_lightning import balance, plots
from dynmo_lightning.bench.page import report_bench

#: Files that make a directory a ``dynmo-bench`` output.
BENCH_FILES = ("simulated.json", "real.json", "layer_costs.json")


# --------------------------------------------------------------------------------------------------- one run


def plot_run(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Plot one training run; a plot whose input is missing is skipped.

    Writes ``loss.png`` (train loss per step, validation points), ``stage_load.png`` (per-stage forward+backward
    time and max/mean imbalance per profiled step, from ``costs.jsonl``), ``partitions.png`` (layers per stage over
    time) and ``world_size.png`` (pipeline processes over time).

    Args:
        run_dir: directory written by ``dynmo-train`` (``summary.json``, optionally ``costs.jsonl`` and
            ``csv/metrics.csv``).
        out_dir: where the PNGs go; ``run_dir / "plots"`` by default.

    Returns:
        Paths of the PNGs written.

    Raises:
        FileNotFoundError: if ``run_dir`` has no ``summary.json``.

    """
    run_dir = Path(run_dir)
    summary = _read_json(run_dir / "summary.json")
    if not isinstance(summary, Mapping):
        raise FileNotFoundError(f"{run_dir} has no readable summary.json; point at a dynmo-train run directory")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    metrics = _read_metrics(run_dir / "csv" / "metrics.csv")
    costs = _read_jsonl(run_dir / "costs.jsonl")
    end = summary.get("steps")

    paths = [
        _run_loss(summary, metrics, out / "loss.png"),
        _run_stage_loads(costs, out / "stage_load.png"),
    ]
    partitions = summary.get("partitions") or []
    if partitions:
        fig, ax = plots.figure(1, 1)
        _plot_partitions(ax[0, 0], partitions, end)
        ax[0, 0].set_title("Partition: layers per stage")
        paths.append(plots.save(fig, out / "partitions.png"))
    world = summary.get("world_size") or []
    if world:
        fig, ax = plots.figure(1, 1, height=3.5)
        _plot_world_size(ax[0, 0], world, end)
        ax[0, 0].set_title("World size: pipeline processes")
        paths.append(plots.save(fig, out / "world_size.png"))
    return [p for p in paths if p is not None]


def _run_loss(summary: Mapping[str, Any], metrics: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    # summary.json has every step's loss; the CSV logger only every log_every_n_steps, so it is the fallback.
    losses = [float("nan") if x is None else float(x) for x in summary.get("losses") or []]
    train = list(enumerate(losses)) if losses else metrics.get("train_loss", [])
    val = metrics.get("val_loss", [])
    if not val and summary.get("val_loss") is not None:
        val = [(int(summary.get("steps") or len(losses)), float(summary["val_loss"]))]
    if not train and not val:
        return None
    fig, ax = plots.figure(1, 1)
    ax = ax[0, 0]
    if train:
        ax.plot(*zip(*train, strict=True), lw=1.2, label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o", ms=6, color="C3", label="validation")
    ax.set(title="Loss", xlabel="step", ylabel="cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    return plots.save(fig, path)


def _run_stage_loads(records: list[dict[str, Any]], path: Path) -> Path | None:
    steps: list[int] = []
    loads: list[list[float]] = []
    splits: list[tuple[int, ...]] = []
    for record in records:
        try:
            per_layer = [f + b for f, b in zip(record["fwd"], record["bwd"], strict=True)]
            stage = balance.stage_loads(per_layer, record["layers_per_stage"])
        except (KeyError, TypeError, ValueError):
            continue  # a record from an interrupted or older run: plot the others
        steps.append(int(record["step"]))
        loads.append([1e3 * x for x in stage])
        splits.append(tuple(record["layers_per_stage"]))
    if not steps:
        return None
    fig, ax = plots.figure(2, 1, height=6.0, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    matrix = plots.pad(loads)
    plots.plot_stage_lines(ax[0, 0], steps, matrix)
    ax[0, 0].set(title="Per-stage load (forward + backward)", ylabel="time per micro-batch (ms)")
    ax[1, 0].plot(steps, plots.imbalance(matrix), color="k", lw=1.2, label="max / mean")
    ax[1, 0].axhline(1.0, color="grey", ls=":", lw=1, label="perfect balance")
    ax[1, 0].set(xlabel="step", ylabel="imbalance")
    # Dotted lines where the balancer changed the split show its decisions against the load it saw.
    changes = [s for s, prev, cur in zip(steps[1:], splits, splits[1:], strict=False) if prev != cur]
    for panel in (ax[0, 0], ax[1, 0]):
        for i, s in enumerate(changes):
            panel.axvline(s, color="grey", ls="--", lw=0.8, label="re-partition" if i == 0 else None)
        panel.grid(alpha=0.3)
        panel.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return plots.save(fig, path)


# --------------------------------------------------------------------------------------------------- console script


def main(argv: Sequence[str] | None = None) -> None:
    """``dynmo-report DIR [--out DIR]``: plot a training run, or rebuild a benchmark directory's report.

    A directory holding a ``dynmo-bench`` result (``simulated.json``, ``real.json`` or ``layer_costs.json``) gets its
    ``benchmarks.md`` and ``plots/`` rebuilt from those files; a directory with ``summary.json`` is a training run
    (:func:`plot_run`). The paths written are printed, one per line.

    Args:
        argv: command-line arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Raises:
        SystemExit: if ``DIR`` holds neither.
    """
    parser = argparse.ArgumentParser(prog="dynmo-report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a dynmo-train run directory or a dynmo-bench output directory")
    parser.add_argument("--out", type=Path, default=None, help="training runs: directory of the PNGs")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir
    if any((run_dir / name).is_file() for name in BENCH_FILES):
        paths = [*report_bench(run_dir), run_dir / "benchmarks.md"]
    elif (run_dir / "summary.json").is_file():
        try:
            paths = plot_run(run_dir, args.out)
        except FileNotFoundError as err:  # summary.json exists but is not valid JSON
            raise SystemExit(f"dynmo-report: {err}") from err
    else:
        raise SystemExit(
            f"dynmo-report: {run_dir} has neither summary.json (a dynmo-train run) nor the results of dynmo-bench "
            f"({', '.join(BENCH_FILES)}); pass one of those directories"
        )
    for path in paths:
        print(path)


def _plot_partitions(ax: Axes, partitions: Sequence[Mapping[str, Any]], end: int | None) -> None:
    steps, splits = _step_series(partitions, "layers_per_stage", end)
    counts = plots.pad(splits, fill=0.0)
    # A split holds from its step until the next one: a step function, stacked so the total is the layer count.
    n = counts.shape[1]
    labels = [f"stage {i}" for i in range(n)]
    ax.stackplot(steps, counts.T, labels=labels, step="post", alpha=0.85, colors=plots.stage_colors(n))
    ax.set(xlabel="step", ylabel="layers")
    ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    plots.stage_legend(ax, n, loc="upper left", bbox_to_anchor=(1.01, 1))


def _plot_world_size(ax: Axes, points: Sequence[Mapping[str, Any]], end: int | None) -> None:
    steps, sizes = _step_series(points, "world_size", end)
    ax.step(steps, sizes, where="post", lw=1.5, marker="o", ms=3)
    ax.set(xlabel="step", ylabel="processes", ylim=(0, max(sizes) + 1))
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)


def _step_series(points: Sequence[Mapping[str, Any]], key: str, end: int | None) -> tuple[list[int], list[Any]]:
    """Steps and values of a change log ``[{"step", key}]``, the last value repeated at ``end`` to show its span."""
    ordered = sorted(points, key=lambda p: p["step"])
    steps = [int(p["step"]) for p in ordered]
    values = [p[key] for p in ordered]
    if end is not None and end > steps[-1]:
        steps.append(int(end))
        values.append(values[-1])
    return steps, values


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; blank and unreadable lines (a run killed mid-write) are skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Columns of Lightning's ``metrics.csv`` as ``(step, value)`` pairs of the non-blank cells."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {}
    columns: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        step = _float(row.get("step"))
        if not math.isfinite(step):
            continue
        for key, cell in row.items():
            value = _float(cell)
            if key and key != "step" and cell not in (None, "") and math.isfinite(value):
                columns.setdefault(key, []).append((int(step), value))
    return columns
