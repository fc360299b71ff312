"""The benchmark page's plots: speed-ups per dynamic and P, strength sweeps, stage loads over steps, the real A/B."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_lightning import balance
from dynmo_lightning.bench import NAMES
from dynmo_lightning.bench.scale import SEED
from dynmo_lightning.plots import TIMES, figure, plot_stage_lines, save


def plot_speedups(sim: Mapping[str, Any], path: Path) -> Path:
    """Grouped bars per dynamic at every P: oracle, DynMo, static_time, params; the seed's figure as a marker."""
    dynamics = [d for d in sim["dynamics"] if d != "none"]
    stages = list(next(iter(sim["dynamics"].values()))["by_stages"])
    fig, ax = figure(1, len(stages), width=5.0 * len(stages), height=4.5, sharey=True)
    bars = (("oracle", "oracle"), ("optimal", "DynMo optimal"), ("static_time", "static_time"), ("params", "params"))
    for col, p in enumerate(stages):
        panel = ax[0, col]
        x = np.arange(len(dynamics))
        runs = [sim["dynamics"][d]["by_stages"][p] for d in dynamics]
        for k, (key, label) in enumerate(bars):
            values = [cmp["oracle"]["speedup"] if key == "oracle" else cmp["policies"][key]["speedup"] for cmp in runs]
            panel.bar(x + (k - 1.5) * 0.2, values, 0.2, label=label)
        panel.scatter(x, [SEED[d] for d in dynamics], marker="*", s=120, color="k", zorder=3, label="seed (paper)")
        panel.axhline(1.0, color="grey", lw=0.8, ls=":")
        panel.set_xticks(x, [NAMES[d] for d in dynamics], rotation=30, ha="right")
        panel.set(title=f"P = {p}", ylabel=f"speed-up over uniform ({TIMES})" if col == 0 else None)
        panel.grid(axis="y", alpha=0.3)
    ax[0, -1].legend(fontsize="small")
    return save(fig, path)


def plot_sweeps(sim: Mapping[str, Any], path: Path) -> Path | None:
    """The oracle's and DynMo's speed-up against each dynamic's strength, the seed's figure as a line."""
    from dynmo_lightning.bench.timeline import PRESETS

    dynamics = [d for d, e in sim["dynamics"].items() if e.get("strength_sweep")]
    if not dynamics:
        return None
    fig, ax = figure(2, math.ceil(len(dynamics) / 2), width=12.0, height=7.0)
    for k, dynamic in enumerate(dynamics):
        panel = ax.flat[k]
        sweep = sim["dynamics"][dynamic]["strength_sweep"]
        xs = [p["strength"] for p in sweep]
        panel.plot(xs, [p["oracle_speedup"] for p in sweep], "o-", label="oracle")
        panel.plot(xs, [p["optimal_speedup"] for p in sweep], "s--", label="DynMo optimal")
        panel.axhline(SEED[dynamic], color="k", ls=":", label="seed")
        panel.set(title=NAMES[dynamic], xlabel=PRESETS[dynamic].strength, ylabel=TIMES)
        panel.grid(alpha=0.3)
    ax.flat[0].legend(fontsize="small")
    for panel in ax.flat[len(dynamics) :]:
        panel.axis("off")
    return save(fig, path)


def plot_stage_loads(trace: Sequence[Mapping[str, Any]], cmp: Mapping[str, Any], dynamic: str, path: Path) -> Path:
    """Per-stage load over the steps under the uniform split and under DynMo's splits (at one P)."""
    fig, ax = figure(1, 2, width=12.0, height=4.0, sharey=True)
    steps = [e["step"] for e in trace]
    for col, policy in enumerate(("uniform", "optimal")):
        changes = cmp["policies"][policy]["partitions"]
        loads = []
        for entry in trace:
            split = [s for step, s in changes if step <= entry["step"]][-1]
            costs = [f + b for f, b in zip(entry["fwd"], entry["bwd"], strict=True)]
            loads.append(balance.stage_loads(costs, split))
        plot_stage_lines(ax[0, col], steps, np.array(loads))
        ax[0, col].set(title=f"{NAMES.get(dynamic, dynamic)}, P={cmp['n_stages']}: {policy}", xlabel="step")
        ax[0, col].grid(alpha=0.3)
    ax[0, 0].set_ylabel("stage forward + backward per micro-batch (s)")
    return save(fig, path)


def plot_real(real: Mapping[str, Any], path: Path) -> Path:
    """DynMo's measured ratio to uniform per repeat, its 95 % interval and the ideal ratio of the same window."""
    rows = [r for r in real["rows"] if r["policy"] == "optimal"]
    fig, ax = figure(1, 1, width=7.0, height=4.0)
    panel = ax[0, 0]
    for k, row in enumerate(rows):
        labels = ("repeats", "mean, 95 %", "ideal") if k == 0 else (None, None, None)
        panel.scatter([k] * len(row["ratios"]), row["ratios"], color="C0", alpha=0.5, label=labels[0])
        error = [[row["ratio"] - row["ratio_low"]], [row["ratio_high"] - row["ratio"]]]
        panel.errorbar(k, row["ratio"], yerr=error, fmt="o", color="C1", capsize=6, label=labels[1])
        if row["ideal_ratio"]:
            panel.scatter(k, row["ideal_ratio"], marker="_", s=600, color="k", label=labels[2])
    panel.axhline(1.0, color="grey", ls=":")
    panel.set_xticks(range(len(rows)), [NAMES.get(r["dynamic"], r["dynamic"]) for r in rows])
    panel.set(ylabel=f"DynMo / uniform tokens per second ({TIMES})", title="Real A/B on this machine's 2 ranks")
    panel.grid(axis="y", alpha=0.3)
    panel.legend(fontsize="small")
    return save(fig, path)
