"""Plots and tables of training runs and benchmarks: the ``dynmo-report`` console script.

* :func:`plot_run` - a ``dynmo-train`` run directory: loss curve, per-stage load and imbalance (from
  ``costs.jsonl``), partition timeline and world size (from ``summary.json``).
* :func:`plot_bench` - a ``dynmo-bench`` results dict: speed-ups next to the seed's figures, static against balanced
  stage loads, the balanced partition timeline, consolidation's world size and imbalance per policy.
* :func:`markdown_table` - the results dict as Markdown tables.
* :func:`main` - ``dynmo-report RUN_DIR [--out DIR] [--stages P]``.

Figures are drawn on :class:`~matplotlib.figure.Figure` objects with an Agg canvas, never through ``pyplot``: no
display is needed, no backend is switched for the caller and no figure outlives its file.
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

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dynmo_lightning import balance

#: Resolution of every PNG.
DPI = 120
#: Display order of dynamics and policies; names outside these lists follow in the order they first appear.
DYNAMICS = ("none", "freezing", "pruning", "early_exit", "mod", "moe", "sparse_attention")
POLICIES = ("uniform", "params", "static_time", "optimal", "diffusion", "optimal+repack")
#: The static split speed-ups are measured against, the balanced policy the plots show, and consolidation.
STATIC = "uniform"
BALANCED = "optimal"
REPACK = "optimal+repack"
#: Multiplication sign of speed-ups (escaped: ruff flags the literal as confusable with "x").
TIMES = "\u00d7"


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
        fig, ax = _figure(1, 1)
        _plot_partitions(ax[0, 0], partitions, end)
        ax[0, 0].set_title("Partition: layers per stage")
        paths.append(_save(fig, out / "partitions.png"))
    world = summary.get("world_size") or []
    if world:
        fig, ax = _figure(1, 1, height=3.5)
        _plot_world_size(ax[0, 0], world, end)
        ax[0, 0].set_title("World size: pipeline processes")
        paths.append(_save(fig, out / "world_size.png"))
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
    fig, ax = _figure(1, 1)
    ax = ax[0, 0]
    if train:
        ax.plot(*zip(*train, strict=True), lw=1.2, label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o", ms=6, color="C3", label="validation")
    ax.set(title="Loss", xlabel="step", ylabel="cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


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
    fig, ax = _figure(2, 1, height=6.0, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    matrix = _pad(loads)
    _plot_stage_lines(ax[0, 0], steps, matrix)
    ax[0, 0].set(title="Per-stage load (forward + backward)", ylabel="time per micro-batch (ms)")
    ax[1, 0].plot(steps, _imbalance(matrix), color="k", lw=1.2, label="max / mean")
    ax[1, 0].axhline(1.0, color="grey", ls=":", lw=1, label="perfect balance")
    ax[1, 0].set(xlabel="step", ylabel="imbalance")
    # Dotted lines where the balancer changed the split show its decisions against the load it saw.
    changes = [s for s, prev, cur in zip(steps[1:], splits, splits[1:], strict=False) if prev != cur]
    for panel in (ax[0, 0], ax[1, 0]):
        for i, s in enumerate(changes):
            panel.axvline(s, color="grey", ls="--", lw=0.8, label="re-partition" if i == 0 else None)
        panel.grid(alpha=0.3)
        panel.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


# --------------------------------------------------------------------------------------------------- benchmarks


def plot_bench(results: Mapping[str, Any], out_dir: str | os.PathLike[str], n_stages: int | None = None) -> list[Path]:
    """Plot a ``dynmo-bench`` results dict.

    Writes ``speedup.png`` (grouped bars per dynamic: best measured balanced ratio to uniform, best simulated
    speed-up over uniform at each P, the seed's figure); per dynamic ``stage_load_{dynamic}_P{P}.png`` (uniform and
    optimal side by side), ``partitions_{dynamic}_P{P}.png`` (the balanced policy's split over time) and
    ``imbalance_{dynamic}_P{P}.png`` (one line per policy); and ``world_size_P{P}.png`` (``optimal+repack``'s
    processes over time, one panel per dynamic).

    Args:
        results: the contents of ``results.json``.
        out_dir: where the PNGs go.
        n_stages: the P of the per-dynamic plots; by default (or when a dynamic was not simulated at it) the
            largest P simulated for that dynamic.

    Returns:
        Paths of the PNGs written.

    """
    out = Path(out_dir)
    paths = [_bench_speedups(results, out / "speedup.png")]
    repack: dict[str, Mapping[str, Any]] = {}
    for dynamic, entries in _by_dynamic(results.get("simulated") or []).items():
        p = _chosen_stages(entries, n_stages)
        by_policy = {e["policy"]: e for e in _ordered(entries, "policy", POLICIES) if e.get("n_stages") == p}
        static, balanced = by_policy.get(STATIC), _balanced(by_policy)
        tag = f"{dynamic}_P{p}"
        if static is not None and balanced is not None:
            paths.append(_bench_stage_loads(dynamic, p, static, balanced, out / f"stage_load_{tag}.png"))
        if balanced is not None and balanced.get("partitions"):
            fig, ax = _figure(1, 1)
            _plot_partitions(ax[0, 0], balanced["partitions"], _last_step(balanced))
            ax[0, 0].set_title(f"{dynamic}: partition under {balanced['policy']}, P={p}")
            paths.append(_save(fig, out / f"partitions_{tag}.png"))
        paths.append(_bench_imbalance(dynamic, p, by_policy, out / f"imbalance_{tag}.png"))
        if REPACK in by_policy and by_policy[REPACK].get("world_sizes"):
            repack[dynamic] = by_policy[REPACK]
    if repack:
        paths.append(_bench_world_sizes(repack, n_stages, out))
    return [p for p in paths if p is not None]


def _bench_speedups(results: Mapping[str, Any], path: Path) -> Path | None:
    seed = results.get("seed") or {}
    real = _by_dynamic(results.get("real") or [])
    sim = _by_dynamic(results.get("simulated") or [])
    dynamics = _order({*seed, *real, *sim}, DYNAMICS)
    if not dynamics:
        return None
    series: list[tuple[str, list[float]]] = []
    if real:
        best = [_best(real.get(d, []), "ratio_to_uniform")[0] for d in dynamics]
        series.append(("measured (best balanced / uniform)", best))
    for p in sorted({int(e["n_stages"]) for entries in sim.values() for e in entries}):
        best = [_best([e for e in sim.get(d, []) if e["n_stages"] == p], "speedup_over_uniform")[0] for d in dynamics]
        series.append((f"simulated P={p} (best balanced)", best))
    if seed:
        series.append(("seed (DynMo paper)", [_float(seed.get(d)) for d in dynamics]))
    fig, ax = _figure(1, 1, width=max(8.0, 1.6 * len(dynamics) + 2), height=5.0)
    ax = ax[0, 0]
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(dynamics))
    for i, (label, values) in enumerate(series):
        # Bars only where a value exists: a dynamic missing from one source leaves a gap, not a "nan" label.
        keep = [j for j, v in enumerate(values) if math.isfinite(v)]
        bars = ax.bar(x[keep] + (i - (len(series) - 1) / 2) * width, [values[j] for j in keep], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=1)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xticks(x, dynamics)
    ax.set(title="Speed-up over the static uniform split", xlabel="dynamic", ylabel=f"speed-up ({TIMES})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _bench_stage_loads(
    dynamic: str, p: int, static: Mapping[str, Any], balanced: Mapping[str, Any], path: Path
) -> Path | None:
    panels = [(e, e.get("steps") or [], e.get("stage_loads") or []) for e in (static, balanced)]
    if not all(steps and loads for _, steps, loads in panels):
        return None
    fig, ax = _figure(1, 2, width=12.0, sharey=True)
    for axis, (entry, steps, loads) in zip(ax[0], panels, strict=True):
        _plot_stage_lines(axis, steps, _pad(loads))
        speedup = _float(entry.get("speedup_over_uniform"))
        axis.set(title=f"{entry['policy']} (speed-up {_ratio(speedup)})", xlabel="step")
        axis.grid(alpha=0.3)
        _stage_legend(axis, p, ncol=max(1, p // 8))
    ax[0, 0].set_ylabel("stage load (s)")
    fig.suptitle(f"{dynamic}: per-stage load, static vs balanced, P={p}")
    return _save(fig, path)


def _bench_imbalance(dynamic: str, p: int, by_policy: Mapping[str, Mapping[str, Any]], path: Path) -> Path | None:
    lines = [(policy, e["steps"], e["imbalance"]) for policy, e in by_policy.items() if e.get("imbalance")]
    if not lines:
        return None
    fig, ax = _figure(1, 1)
    ax = ax[0, 0]
    for policy, steps, values in lines:
        ax.plot(steps, values, lw=1.2, label=policy)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set(title=f"{dynamic}: imbalance (max / mean stage load), P={p}", xlabel="step", ylabel="imbalance")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _bench_world_sizes(repack: Mapping[str, Mapping[str, Any]], n_stages: int | None, out: Path) -> Path:
    # One panel per dynamic: on a shared axis the step lines of dynamics that shrink alike would hide each other.
    ncols = min(3, len(repack))
    nrows = math.ceil(len(repack) / ncols)
    fig, ax = _figure(nrows, ncols, width=4.0 * ncols, height=3.0 * nrows, sharey=True, squeeze=False)
    for axis, (dynamic, entry) in zip(ax.flat, repack.items(), strict=False):
        _plot_world_size(axis, entry["world_sizes"], _last_step(entry))
        axis.set_title(f"{dynamic}, P={entry['n_stages']}")
    for axis in list(ax.flat)[len(repack) :]:
        axis.set_visible(False)
    fig.suptitle(f"{REPACK}: pipeline processes over time")
    p = n_stages if n_stages is not None else max(int(e["n_stages"]) for e in repack.values())
    return _save(fig, out / f"world_size_P{p}.png")


# --------------------------------------------------------------------------------------------------- Markdown


def markdown_table(results: Mapping[str, Any]) -> str:
    """The results of ``dynmo-bench`` as Markdown: setup, real runs, simulated runs, summary against the seed.

    Args:
        results: the contents of ``results.json``.

    Returns:
        Markdown text ending in a newline.

    """
    seed = results.get("seed") or {}
    real = _by_dynamic(results.get("real") or [])
    sim = _by_dynamic(results.get("simulated") or [])
    lines = ["# DynMo benchmarks", ""]
    machine = results.get("machine") or {}
    if machine:
        lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), ""]
    if results.get("config"):
        lines += ["```json", json.dumps(results["config"], indent=2, sort_keys=True), "```", ""]

    if real:
        lines += [
            "## Real runs",
            "",
            "| dynamic | policy | tokens/s (mean ± sd, n) | ratio to uniform | ideal ratio |",
            "|---|---|---:|---:|---:|",
        ]
        for dynamic, entries in real.items():
            for e in _ordered(entries, "policy", POLICIES):
                lines.append(
                    f"| {dynamic} | {e['policy']} | {_tokens(e)} | {_ratio(_float(e.get('ratio_to_uniform')))} "
                    f"| {_ratio(_float(e.get('ideal_ratio')))} |"
                )
        lines.append("")

    if sim:
        lines += [
            "## Simulated runs",
            "",
            "| dynamic | P | policy | speed-up over uniform | over params | rank-seconds saved |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for dynamic, entries in sim.items():
            rows = sorted(_ordered(entries, "policy", POLICIES), key=lambda e: e["n_stages"])  # stable: keeps policy
            for e in rows:
                lines.append(
                    f"| {dynamic} | {e['n_stages']} | {e['policy']} "
                    f"| {_ratio(_float(e.get('speedup_over_uniform')))} "
                    f"| {_ratio(_float(e.get('speedup_over_params')))} "
                    f"| {_percent(_float(e.get('rank_seconds_saved')))} |"
                )
        lines.append("")

    dynamics = _order({*seed, *real, *sim}, DYNAMICS)
    if dynamics:
        lines += [
            "## Summary against the seed",
            "",
            "The seed's figures are the DynMo paper's end-to-end speed-ups over static splits at cluster scale.",
            "",
            "| dynamic | best measured (policy) | best simulated (policy, P) | seed | simulated / seed |",
            "|---|---:|---:|---:|---:|",
        ]
        for dynamic in dynamics:
            measured, m_entry = _best(real.get(dynamic, []), "ratio_to_uniform")
            simulated, s_entry = _best(sim.get(dynamic, []), "speedup_over_uniform")
            seed_value = _float(seed.get(dynamic))
            share = simulated / seed_value if seed_value else math.nan
            m_text = f"{_ratio(measured)} ({m_entry['policy']})" if m_entry else "—"
            s_text = f"{_ratio(simulated)} ({s_entry['policy']}, P={s_entry['n_stages']})" if s_entry else "—"
            lines.append(f"| {dynamic} | {m_text} | {s_text} | {_ratio(seed_value)} | {_number(share)} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- console script


def main(argv: Sequence[str] | None = None) -> None:
    """``dynmo-report RUN_DIR [--out DIR] [--stages P]``: plot a training run or a benchmark directory.

    A directory with ``results.json`` is a benchmark: its plots go to ``--out`` (default ``RUN_DIR/plots``) and its
    tables, with links to the plots, to ``RUN_DIR/benchmarks.md``. A directory with ``summary.json`` is a training
    run: :func:`plot_run`. The paths written are printed, one per line.

    Args:
        argv: command-line arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Raises:
        SystemExit: if ``RUN_DIR`` holds neither ``summary.json`` nor ``results.json``.

    """
    parser = argparse.ArgumentParser(prog="dynmo-report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a dynmo-train run directory or a dynmo-bench output directory")
    parser.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: RUN_DIR/plots)")
    parser.add_argument("--stages", type=int, default=None, help="benchmarks: the P of the per-dynamic plots")
    args = parser.parse_args(argv)
    run_dir: Path = args.run_dir

    if (run_dir / "results.json").is_file():
        results = _read_json(run_dir / "results.json")
        if not isinstance(results, Mapping):
            raise SystemExit(f"dynmo-report: {run_dir / 'results.json'} is not a JSON object of dynmo-bench results")
        out = args.out if args.out is not None else run_dir / "plots"
        paths = plot_bench(results, out, n_stages=args.stages)
        md = run_dir / "benchmarks.md"
        links = [f"![{p.stem}]({Path(os.path.relpath(p.resolve(), run_dir.resolve())).as_posix()})" for p in paths]
        md.write_text(markdown_table(results) + "\n## Plots\n\n" + "\n\n".join(links) + "\n")
        paths.append(md)
    elif (run_dir / "summary.json").is_file():
        try:
            paths = plot_run(run_dir, args.out)
        except FileNotFoundError as err:  # summary.json exists but is not valid JSON
            raise SystemExit(f"dynmo-report: {err}") from err
    else:
        raise SystemExit(
            f"dynmo-report: {run_dir} has neither summary.json (a dynmo-train run) nor results.json "
            "(a dynmo-bench output); pass one of those directories"
        )
    for path in paths:
        print(path)


# --------------------------------------------------------------------------------------------------- helpers


def _figure(nrows: int, ncols: int, *, width: float = 8.0, height: float = 4.5, **kwargs: Any) -> tuple[Figure, Any]:
    """A constrained-layout figure on its own Agg canvas and its axes as a 2-D array."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    kwargs.setdefault("squeeze", False)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


#: Beyond this many stages a legend would cover the plot: stages are coloured along a colour map instead.
_MANY_STAGES = 16


def _stage_colors(n: int) -> list[Any] | None:
    """Colours for ``n`` stages: matplotlib's cycle for a few, a sequential map (first dark, last light) for many."""
    if n <= _MANY_STAGES:
        return None
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _stage_legend(ax: Axes, n: int, **kwargs: Any) -> None:
    """A legend for a few stages; a note on the colour map for many."""
    if n <= _MANY_STAGES:
        ax.legend(fontsize="small", **kwargs)
    else:
        ax.text(
            0.99,
            0.98,
            f"colour: stage 0 (dark) to {n - 1} (light)",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize="small",
        )


def _plot_stage_lines(ax: Axes, steps: Sequence[int], loads: np.ndarray) -> None:
    # NaN cells (stages a consolidated pipeline no longer has) break the line instead of drawing zeros.
    colors = _stage_colors(loads.shape[1])
    for stage in range(loads.shape[1]):
        color = colors[stage] if colors else None
        ax.plot(steps, loads[:, stage], lw=1.2, label=f"stage {stage}", color=color)


def _plot_partitions(ax: Axes, partitions: Sequence[Mapping[str, Any]], end: int | None) -> None:
    steps, splits = _step_series(partitions, "layers_per_stage", end)
    counts = _pad(splits, fill=0.0)
    # A split holds from its step until the next one: a step function, stacked so the total is the layer count.
    n = counts.shape[1]
    labels = [f"stage {i}" for i in range(n)]
    ax.stackplot(steps, counts.T, labels=labels, step="post", alpha=0.85, colors=_stage_colors(n))
    ax.set(xlabel="step", ylabel="layers")
    ax.set_xlim(steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1)
    _stage_legend(ax, n, loc="upper left", bbox_to_anchor=(1.01, 1))


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


def _pad(rows: Sequence[Sequence[float]], fill: float = math.nan) -> np.ndarray:
    """Rows of different lengths (the stage count changes when the pipeline consolidates) as one matrix."""
    width = max(len(r) for r in rows)
    matrix = np.full((len(rows), width), fill)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = row
    return matrix


def _imbalance(loads: np.ndarray) -> np.ndarray:
    """Largest over mean stage load per row, ignoring absent (NaN) stages; 1 where nothing ran."""
    peak, mean = np.nanmax(loads, axis=1), np.nanmean(loads, axis=1)
    return np.divide(peak, mean, out=np.ones_like(mean), where=mean > 0)


def _last_step(entry: Mapping[str, Any]) -> int | None:
    steps = entry.get("steps") or []
    return max(steps) if steps else None


def _chosen_stages(entries: Sequence[Mapping[str, Any]], n_stages: int | None) -> int:
    available = {int(e["n_stages"]) for e in entries}
    return n_stages if n_stages in available else max(available)


def _balanced(by_policy: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The optimal policy's entry, or else the fastest non-uniform one."""
    if BALANCED in by_policy:
        return by_policy[BALANCED]
    return _best(list(by_policy.values()), "speedup_over_uniform")[1]


def _best(entries: Sequence[Mapping[str, Any]], key: str) -> tuple[float, Mapping[str, Any] | None]:
    """The largest ``key`` among the balanced (non-uniform) entries, and its entry; NaN and ``None`` if none."""
    scored = [(_float(e.get(key)), e) for e in entries if e.get("policy") != STATIC]
    scored = [(v, e) for v, e in scored if math.isfinite(v)]
    return max(scored, key=lambda s: s[0]) if scored else (math.nan, None)


def _by_dynamic(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for entry in entries:
        groups.setdefault(entry["dynamic"], []).append(entry)
    return {d: groups[d] for d in _order(groups, DYNAMICS)}


def _order(names: Any, known: Sequence[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return [n for n in known if n in names] + sorted(n for n in names if n not in known)


def _ordered(entries: Sequence[Mapping[str, Any]], key: str, known: Sequence[str]) -> list[Mapping[str, Any]]:
    rank = {name: i for i, name in enumerate(_order([e[key] for e in entries], known))}
    return sorted(entries, key=lambda e: rank[e[key]])


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _number(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "—"


def _ratio(value: float) -> str:
    return f"{value:.2f}{TIMES}" if math.isfinite(value) else "—"


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%" if math.isfinite(value) else "—"


def _tokens(entry: Mapping[str, Any]) -> str:
    repeats = [float(x) for x in entry.get("tokens_per_s") or []]
    mean = _float(entry.get("mean_tokens_per_s"))
    if not math.isfinite(mean) and repeats:
        mean = float(np.mean(repeats))
    if not math.isfinite(mean):
        return "—"
    spread = f" ± {np.std(repeats, ddof=1):,.0f}" if len(repeats) > 1 else ""
    return f"{mean:,.0f}{spread} (n={len(repeats)})"


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
