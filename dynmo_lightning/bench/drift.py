"""How far each dynamic moves the per-layer costs, and what that leaves a split balanced once to lose.

A cost trace (``traces/<dynamic>.jsonl.gz``) holds every layer's forward and backward time at every step.
Re-balancing during training can pay only where the costs drift apart *after* the split was chosen:

* :func:`layer_drift` - do the blocks' costs spread apart as training runs? Their coefficient of variation (standard
  deviation over mean, across the blocks; the embedding and the head never change and are left out) at the start and
  at the end, and how far each block's cost moved (its cost at the end over its cost at the start).
* :func:`split_drift` - does a split balanced once (``static_time``'s) fall out of balance? Its largest stage load
  over its smallest at the start and at the end, and its slowest stage over the slowest stage of the best split of
  the same step's costs, summed over the run: the room a re-split has by stage loads alone (the simulator's oracle
  prices the schedule's whole task order, fill and drain included).
* :func:`expert_spread` - Mixture of Experts: the busiest expert's tokens over the mean expert's, the imbalance that
  routing creates *inside* a layer (it matters under expert parallelism, not to a pipeline stage).

"The start" and "the end" are the first and the last tenth of the steps, the costs averaged over each.
:func:`drift_section` is the report's section of them, for the presets at every P and along the strength sweeps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_lightning import balance
from dynmo_lightning.bench import NAMES, layer_costs, read_json, timeline_path
from dynmo_lightning.plots import DASH, TIMES
from dynmo_lightning.sim import load_trace

#: Share of the steps that make "the start" and "the end".
WINDOW = 0.1


@dataclasses.dataclass(frozen=True)
class LayerDrift:
    """How the blocks' costs (forward + backward) moved over a trace.

    Attributes:
        cv_start: coefficient of variation across the blocks at the start.
        cv_end: the same at the end.
        change_min: the smallest of the blocks' cost at the end over its cost at the start.
        change_max: the largest of them.
        total_change: the blocks' summed cost at the end over the start.
    """

    cv_start: float
    cv_end: float
    change_min: float
    change_max: float
    total_change: float


@dataclasses.dataclass(frozen=True)
class SplitDrift:
    """How one fixed split's stage loads moved over a trace.

    Attributes:
        spread_start: the largest stage load over the smallest at the start.
        spread_end: the same at the end.
        excess: the split's slowest stage over the best split's slowest stage of each step, summed over the steps.
        slowest_end: which stage is the slowest at the end (0: the first).
    """

    spread_start: float
    spread_end: float
    excess: float
    slowest_end: int


def step_costs(trace: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Every step's per-layer forward + backward time, ``(steps, layers)``."""
    return np.array([np.add(entry["fwd"], entry["bwd"]) for entry in trace], dtype=float)


def _ends(costs: np.ndarray, window: float) -> tuple[np.ndarray, np.ndarray]:
    """The costs averaged over the first and over the last ``window`` share of the steps (one step at least)."""
    k = max(1, round(window * len(costs)))
    return costs[:k].mean(axis=0), costs[-k:].mean(axis=0)


def layer_drift(trace: Sequence[Mapping[str, Any]], *, ends: int = 1, window: float = WINDOW) -> LayerDrift:
    """The blocks' cost spread at the start and the end of a trace, and how far each block moved.

    Args:
        trace: the cost trace (``fwd`` and ``bwd`` per layer at every step).
        ends: layers left out at either end (the embedding and the head, whose cost no dynamic changes).
        window: the share of the steps averaged into the start and into the end.

    Returns:
        The drift; a block whose cost is zero at the start counts as unchanged.
    """
    costs = step_costs(trace)
    start, end = _ends(costs[:, ends : costs.shape[1] - ends], window)
    change = np.divide(end, start, out=np.ones_like(end), where=start > 0)
    return LayerDrift(
        cv_start=_cv(start),
        cv_end=_cv(end),
        change_min=float(change.min()),
        change_max=float(change.max()),
        total_change=float(end.sum() / start.sum()),
    )


def _cv(costs: np.ndarray) -> float:
    return float(costs.std() / costs.mean())


def split_drift(
    trace: Sequence[Mapping[str, Any]], layers_per_stage: Sequence[int], *, window: float = WINDOW
) -> SplitDrift:
    """How a split chosen once fares as the costs drift: its stage spread at the start and end, its excess.

    Args:
        trace: the cost trace.
        layers_per_stage: the fixed split (every layer of the trace, embedding and head included).
        window: the share of the steps averaged into the start and into the end.

    Returns:
        The drift; the best split of each step is ``balance.partition(method="optimal")`` of its costs.
    """
    costs = step_costs(trace)
    split, best = list(layers_per_stage), {}
    loads = np.array([balance.stage_loads(list(step), split) for step in costs])
    for step in costs:
        key = tuple(step)
        if key not in best:  # traces hold long runs of equal costs
            best[key] = balance.bottleneck(list(key), balance.partition(list(key), len(split), method="optimal"))
    start, end = _ends(loads, window)
    return SplitDrift(
        spread_start=float(start.max() / start.min()),
        spread_end=float(end.max() / end.min()),
        excess=float(loads.max(axis=1).sum() / sum(best[tuple(step)] for step in costs)),
        slowest_end=int(end.argmax()),
    )


def expert_spread(timeline: Mapping[str, Any]) -> float | None:
    """The busiest expert's tokens over the mean expert's, averaged over the MoE layers and steps of a timeline.

    Args:
        timeline: a recorded timeline (``states[step]["experts"][layer]``: each expert's share of the tokens, or
            ``None`` for a layer without experts).

    Returns:
        The mean ratio, ``None`` when no layer has experts.
    """
    ratios = [
        max(shares) * len(shares) / sum(shares)
        for state in timeline["states"]
        for shares in state.get("experts", [])
        if shares and sum(shares) > 0
    ]
    return float(np.mean(ratios)) if ratios else None


# --------------------------------------------------------------------------------------------------- the report
def drift_table(
    sim: Mapping[str, Any], traces: Mapping[str, Sequence[Mapping[str, Any]]], spreads: Mapping[str, float | None]
) -> list[str]:
    """Per dynamic's preset: the blocks' drift, ``static_time``'s split at every P, the oracle's room over it.

    Args:
        sim: ``simulated.json``.
        traces: the preset's cost trace of each dynamic (a dynamic without one is left out).
        spreads: :func:`expert_spread` of each dynamic's preset timeline.
    """
    ps = " / ".join(next(iter(sim["dynamics"].values()))["by_stages"])
    lines = [
        "| dynamic | blocks' cost CV, start → end | a block's cost, end over start | blocks' total, end over start "
        f"| `static_time` split's stage max/min, start → end, P = {ps} | its slowest stage over the best split's, "
        f"P = {ps} | its slowest stage at the end | oracle over `static_time` | busiest expert over the mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dynamic, entry in sim["dynamics"].items():
        if dynamic not in traces:
            continue
        stages, layers = list(entry["by_stages"].values()), layer_drift(traces[dynamic])
        splits = [split_drift(traces[dynamic], cmp["policies"]["static_time"]["partitions"][-1][1]) for cmp in stages]
        room = [cmp["policies"]["static_time"]["total_time"] / cmp["oracle"]["total_time"] for cmp in stages]
        spread, both = spreads.get(dynamic), zip(splits, stages, strict=True)
        lines.append(
            f"| {NAMES.get(dynamic, dynamic)} | {_moved(layers)} "
            f"| {' / '.join(f'{s.spread_start:.2f} → {s.spread_end:.2f}' for s in splits)} "
            f"| {_slashed([s.excess for s in splits])} | {' / '.join(_which(s.slowest_end, cmp) for s, cmp in both)} "
            f"| {_slashed(room)} "
            f"| {'—' if spread is None else f'{spread:.2f}'} |"
        )
    return lines


def sweep_drift_table(
    sim: Mapping[str, Any], sweeps: Mapping[str, Sequence[tuple[float, Sequence[Mapping[str, Any]]]]]
) -> list[str]:
    """Per dynamic and strength of its sweep: the blocks' drift beside the committed oracle speed-up.

    Args:
        sim: ``simulated.json`` (its ``strength_sweep`` entries give the oracle's speed-up over uniform).
        sweeps: per dynamic, ``(strength, cost trace)`` in the sweep's order.
    """
    from dynmo_lightning.bench.timeline import PRESETS

    lines = [
        "| dynamic | strength | blocks' cost CV, start → end | a block's cost, end over start | blocks' total, end "
        "over start | oracle over uniform |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dynamic, runs in sweeps.items():
        oracle = {p["strength"]: p["oracle_speedup"] for p in sim["dynamics"][dynamic].get("strength_sweep", [])}
        for strength, trace in runs:
            lines.append(
                f"| {NAMES.get(dynamic, dynamic)} | {PRESETS[dynamic].strength} {strength:g} "
                f"| {_moved(layer_drift(trace))} | {_slashed([oracle.get(strength, math.nan)])} |"
            )
    return lines if len(lines) > 2 else []


def _moved(drift: LayerDrift) -> str:
    """The three cells of a layer drift: the spread at the start and end, each block's move, the total's."""
    return (
        f"{drift.cv_start:.2f} → {drift.cv_end:.2f} | {drift.change_min:.2f}{DASH}{drift.change_max:.2f} "
        f"| {drift.total_change:.2f}"
    )


def _which(stage: int, cmp: Mapping[str, Any]) -> str:
    """A stage by where it sits: the first, the last (it holds the head), or its number."""
    return {0: "first", cmp["n_stages"] - 1: "last"}.get(stage, str(stage + 1))


def _slashed(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values) + TIMES


def sweep_stages(entry: Mapping[str, Any]) -> str | None:
    """The P a dynamic's strength sweep ran at: the one whose oracle the sweep's preset point repeats.

    ``simulated.json`` does not name it; the preset's point of the sweep replays the preset's trace at that P.
    """
    preset = [p for p in entry.get("strength_sweep", []) if p["strength"] == entry.get("strength")]
    for p, cmp in entry["by_stages"].items():
        if preset and math.isclose(cmp["oracle"]["speedup"], preset[0]["oracle_speedup"], rel_tol=1e-9):
            return p
    return None


def drift_section(directory: str | Path, sim: Mapping[str, Any]) -> list[str]:
    """The report's section on cost drift, from a benchmark directory's traces, timelines and layer costs.

    Args:
        directory: a ``dynmo-bench`` directory (``traces/``, ``timelines/``, ``layer_costs*.json``).
        sim: its ``simulated.json``.

    Returns:
        Markdown lines; empty without traces. The sweep table needs the sweeps' timelines and the layer costs.
    """
    d = Path(directory)
    traces = {
        dynamic: load_trace(path)
        for dynamic in sim["dynamics"]
        if (path := d / "traces" / f"{dynamic}.jsonl.gz").is_file()
    }
    if not traces:
        return []
    spreads = {}
    for dynamic, entry in sim["dynamics"].items():
        path = timeline_path(d, dynamic, entry.get("strength"))
        spreads[dynamic] = expert_spread(read_json(path)) if path.is_file() else None
    stages = " / ".join(next(iter(sim["dynamics"].values()))["by_stages"])
    return [
        "### Cost drift: what re-balancing has to work with",
        "",
        "Per preset trace: how far the blocks' costs (forward + backward; the embedding and the head never change) "
        "spread apart between the start and the end of the run (the first and the last tenth of the steps, "
        f"averaged), and what that does to the split `static_time` chose once, at P = {stages}: its largest stage "
        "load over its smallest; its slowest stage over the slowest stage of the best split of each step's costs, "
        "summed over the run (stage loads alone; the oracle column prices 1F1B's whole task order); which of its "
        "stages is the slowest at the end (the last one holds the head). The last column is the imbalance MoE "
        "routing creates across a layer's experts, which a pipeline stage holding all of them does not see.",
        "",
        *drift_table(sim, traces, spreads),
        "",
        *_sweep_part(d, sim),
    ]


def _sweep_part(d: Path, sim: Mapping[str, Any]) -> list[str]:
    from dynmo_lightning.bench import timeline

    sweeps: dict[str, list[tuple[float, Sequence[Mapping[str, Any]]]]] = {}
    for dynamic, entry in sim["dynamics"].items():
        points = [p["strength"] for p in entry.get("strength_sweep", [])]
        paths = [timeline_path(d, dynamic, s) for s in points]
        table = d / layer_costs.table_file(dynamic)
        if points and table.is_file() and all(path.is_file() for path in paths):
            costs = layer_costs.CostTable(read_json(table))
            runs = zip(points, paths, strict=True)
            sweeps[dynamic] = [(s, timeline.realistic_trace(read_json(path), costs)) for s, path in runs]
    lines = sweep_drift_table(sim, sweeps)
    if not lines:
        return []
    ps = {sweep_stages(sim["dynamics"][dynamic]) for dynamic in sweeps}
    at = f" at P = {ps.pop()}" if len(ps) == 1 and None not in ps else ""
    return [
        f"Along each strength sweep (the same measures; the oracle's speed-up over uniform{at} from the sweep):",
        "",
        *lines,
        "",
    ]
