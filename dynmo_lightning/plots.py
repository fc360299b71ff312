"""Figures shared by the training-run report and the benchmark report (matplotlib, no display needed).

Figures are drawn on :class:`~matplotlib.figure.Figure` objects with an Agg canvas, never through ``pyplot``: no
display is needed, no backend is switched for the caller and no figure outlives its file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Resolution of every PNG.
DPI = 120
#: Multiplication sign of speed-ups (escaped: ruff flags the literal as confusable with "x").
TIMES = "\u00d7"
#: En dash of ranges such as "98-99 %" (escaped for the same reason).
DASH = "\u2013"
#: Beyond this many stages a legend would cover the plot: stages are coloured along a colour map instead.
MANY_STAGES = 16


def figure(nrows: int, ncols: int, *, width: float = 8.0, height: float = 4.5, **kwargs: Any) -> tuple[Figure, Any]:
    """A constrained-layout figure on its own Agg canvas and its axes as a 2-D array."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    kwargs.setdefault("squeeze", False)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` (directories made as needed) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def stage_colors(n: int) -> list[Any] | None:
    """Colours for ``n`` stages: matplotlib's cycle for a few, a sequential map (first dark, last light) for many."""
    if n <= MANY_STAGES:
        return None
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def stage_legend(ax: Axes, n: int, **kwargs: Any) -> None:
    """A legend for a few stages; a note on the colour map for many."""
    if n <= MANY_STAGES:
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


def plot_stage_lines(ax: Axes, steps: Sequence[int], loads: np.ndarray) -> None:
    """One line per stage of a ``(steps, stages)`` load matrix."""
    # NaN cells (stages a consolidated pipeline no longer has) break the line instead of drawing zeros.
    colors = stage_colors(loads.shape[1])
    for stage in range(loads.shape[1]):
        color = colors[stage] if colors else None
        ax.plot(steps, loads[:, stage], lw=1.2, label=f"stage {stage}", color=color)


def pad(rows: Sequence[Sequence[float]], fill: float = math.nan) -> np.ndarray:
    """Rows of different lengths (the stage count changes when the pipeline consolidates) as one matrix."""
    width = max(len(r) for r in rows)
    matrix = np.full((len(rows), width), fill)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = row
    return matrix


def imbalance(loads: np.ndarray) -> np.ndarray:
    """Largest over mean stage load per row, ignoring absent (NaN) stages; 1 where nothing ran."""
    peak, mean = np.nanmax(loads, axis=1), np.nanmean(loads, axis=1)
    return np.divide(peak, mean, out=np.ones_like(mean), where=mean > 0)
