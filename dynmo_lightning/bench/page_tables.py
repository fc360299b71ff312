"""The benchmark page's tables: the simulated runs at scale, the sweeps, consolidation, the real A/B, one layer's costs.

Each takes the results file's dict (``simulated.json``, ``real.json``, ``layer_costs.json``) and returns Markdown lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dynmo_lightning.bench import NAMES
from dynmo_lightning.bench.layer_costs import block_gflops
from dynmo_lightning.bench.page_cells import interval, percent, ratio
from dynmo_lightning.bench.scale import SEED


def headline_table(sim: Mapping[str, Any]) -> list[str]:
    """Per dynamic and number of stages: the oracle, DynMo, the static splits, the loss, the seed."""
    lines = [
        "| dynamic (preset strength) | P | `uniform` s/step | oracle | **DynMo `optimal`** (share of oracle) "
        "| DynMo over `static_time` | oracle over `static_time` | `diffusion` | `static_time` | `params` "
        "| val loss (no dynamic) | seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dynamic, entry in sim["dynamics"].items():
        strength = f" ({entry['strength']})" if entry.get("strength") is not None else ""
        for p, cmp in entry["by_stages"].items():
            pol, loss = cmp["policies"], f"{entry['val_loss']:.3f} ({entry['val_loss_none']:.3f})"
            uniform = f"{pol['uniform']['total_time'] / cmp['n_steps']:.1f}" if cmp.get("n_steps") else "—"
            opt = f"**{ratio(pol['optimal']['speedup'])}** ({percent(pol['optimal']['share_of_oracle'])})"
            # what re-balancing during training adds to a split balanced once on the first measured costs, and
            # the most any balancer could add to it
            rebalance = " | ".join(_over_static(cmp, run) for run in (pol.get("optimal"), cmp["oracle"]))
            others = " | ".join(
                ratio(pol.get(name, {}).get("speedup")) for name in ("diffusion", "static_time", "params")
            )
            lines.append(
                f"| {NAMES.get(dynamic, dynamic)}{strength} | {p} | {uniform} | {ratio(cmp['oracle']['speedup'])} "
                f"| {opt} | {rebalance} | {others} | {loss} | {ratio(SEED.get(dynamic))} |"
            )
    return lines


def _over_static(cmp: Mapping[str, Any], run: Mapping[str, Any] | None) -> str:
    """A run's speed-up over ``static_time`` (profile once, balance once, never move) on the same trace and P."""
    static = cmp["policies"].get("static_time")
    return "—" if static is None or run is None else ratio(static["total_time"] / run["total_time"])


def zero_bubble_table(sim: Mapping[str, Any], schedule: str) -> list[str]:
    """Per dynamic and P: uniform, DynMo and the oracle under one zero-bubble schedule beside DynMo under 1F1B.

    ``simulated.json`` holds them as ``dynamics[<name>]["zero_bubble"][<schedule>][<P>]``.
    """
    lines = [
        "| dynamic | P | DynMo under 1F1B | zero-bubble `uniform` over 1F1B `uniform` | **DynMo zero-bubble** (share "
        "of oracle) | oracle zero-bubble | DynMo zero-bubble over 1F1B `uniform` | migrations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dynamic, entry in sim["dynamics"].items():
        for p, zb in entry.get("zero_bubble", {}).get(schedule, {}).items():
            onef1b, pol = entry["by_stages"][p], zb["policies"]
            base = onef1b["policies"]["uniform"]["total_time"]
            dynmo = pol["optimal"]
            lines.append(
                f"| {NAMES.get(dynamic, dynamic)} | {p} | {ratio(onef1b['policies']['optimal']['speedup'])} "
                f"| {ratio(base / pol['uniform']['total_time'])} "
                f"| **{ratio(dynmo['speedup'])}** ({percent(dynmo['share_of_oracle'])}) "
                f"| {ratio(zb['oracle']['speedup'])} "
                f"| {ratio(base / dynmo['total_time'])} | {dynmo['n_migrations']} |"
            )
    return lines if len(lines) > 2 else []


def sweep_table(sim: Mapping[str, Any]) -> list[str]:
    """Per dynamic: the strength sweep at the sweep's stage count, and where the seed's figure is reached."""
    from dynmo_lightning.bench.timeline import PRESETS

    lines = []
    for dynamic, entry in sim["dynamics"].items():
        sweep = entry.get("strength_sweep")
        if not sweep:
            continue
        reached = entry["seed_reached"]
        verdict = (
            f"reaches the seed's {ratio(SEED[dynamic])} at {PRESETS[dynamic].strength} {reached['strength']}"
            if reached["reached"]
            else f"stays below the seed's {ratio(SEED[dynamic])}: at most {ratio(reached['oracle_speedup'])} "
            f"({PRESETS[dynamic].strength} {reached['strength']})"
        )
        lines += [f"**{NAMES[dynamic]}** ({PRESETS[dynamic].name}): the oracle {verdict}.", ""]
        lines += [f"| {PRESETS[dynamic].strength} | oracle | DynMo `optimal` | share | val loss |"]
        lines += ["|---:|---:|---:|---:|---:|"]
        for point in sweep:
            lines.append(
                f"| {point['strength']} | {ratio(point['oracle_speedup'])} | {ratio(point['optimal_speedup'])} "
                f"| {percent(point['share_of_oracle'])} | {point['val_loss']:.3f} |"
            )
        lines.append("")
    return lines


def bandwidth_table(sim: Mapping[str, Any]) -> list[str]:
    """DynMo's speed-up at the sweep's stage count for migration bandwidths from this machine's to NVLink's."""
    dynamics = [d for d, e in sim["dynamics"].items() if e.get("bandwidth_sweep")]
    if not dynamics:
        return []
    widths = [point["bytes_per_s"] for point in sim["dynamics"][dynamics[0]]["bandwidth_sweep"]]
    lines = ["| dynamic | " + " | ".join(f"{w / 1e9:g} GB/s" for w in widths) + " |", "|---|" + "---:|" * len(widths)]
    for dynamic in dynamics:
        sweep = sim["dynamics"][dynamic]["bandwidth_sweep"]
        cells = [f"{ratio(p['optimal_speedup'])} ({percent(p['share_of_oracle'])})" for p in sweep]
        lines.append(f"| {NAMES.get(dynamic, dynamic)} | " + " | ".join(cells) + " |")
    return lines


def repack_table(sim: Mapping[str, Any]) -> list[str]:
    """Consolidation: ``optimal+repack``'s speed-up, the ranks it ends on and the rank-seconds it saves."""
    lines = [
        "| dynamic | P | `optimal+repack` speed-up | `optimal` speed-up | ranks at the end | rank-seconds saved |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dynamic, entry in sim["dynamics"].items():
        for p, cmp in entry["by_stages"].items():
            repack, uniform = cmp["policies"].get("optimal+repack"), cmp["policies"]["uniform"]
            if repack is None or "rank_seconds" not in repack:
                continue
            saved = 1.0 - repack["rank_seconds"] / uniform["rank_seconds"]
            lines.append(
                f"| {NAMES.get(dynamic, dynamic)} | {p} | {ratio(repack['speedup'])} "
                f"| {ratio(cmp['policies']['optimal']['speedup'])} | {repack['world_size_end']} | {percent(saved)} |"
            )
    return lines if len(lines) > 2 else []


def real_table(real: Mapping[str, Any]) -> list[str]:
    """The A/B runs: each policy against uniform and ``static_time`` (where it ran), with 95 % intervals.

    Beside them the ideal ratio of the same window and the reaction lag.
    """
    lines = [
        "| dynamic | uniform tokens/s | policy | tokens/s | **over uniform** [95 % interval] "
        "| over `static_time` [95 %] | ideal ratio | share of ideal | reaction lag | val loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {(r["dynamic"], r["policy"]): r for r in real["rows"]}
    for dynamic in dict.fromkeys(r["dynamic"] for r in real["rows"]):
        uniform = rows.get((dynamic, "uniform"))
        if uniform is None:
            continue
        for policy in (p for d, p in rows if d == dynamic and p != "uniform"):
            lines.append(_real_row(dynamic, uniform, rows[(dynamic, policy)]))
    return lines


def _real_row(dynamic: str, uniform: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    lag = run.get("reaction_lag_steps")
    lag_text = (f"{lag['max_steps']} steps ({lag['max_intervals']:.1f} profile intervals; moves after "
                f"{lag.get('answered', '?')} of {lag.get('events', '?')} events)" if lag else "—")  # fmt: skip
    name = "DynMo" if run["policy"] == "optimal" else f"`{run['policy']}`"
    static = interval(run["over_static_time"]) if run.get("over_static_time") else "—"
    return (
        f"| {NAMES.get(dynamic, dynamic)} | {np.mean(uniform['tokens_per_s']):,.0f} | {name} "
        f"| {np.mean(run['tokens_per_s']):,.0f} | {interval(run, bold=True)} | {static} | {ratio(run['ideal_ratio'])} "
        f"| {percent(run['share_of_ideal'])} | {lag_text} | {run['val_loss']:.3f} |"
    )


def layer_table(table: Mapping[str, Any]) -> list[str]:
    """What one LLM-sized layer costs here, forward and backward, in the main states."""
    s = table["shape"]
    rows = [
        ("block, trainable", table["block"]["trainable"]),
        ("block, frozen (no autograd)", table["block"]["frozen"]),
        ("attention half, all heads", table["attention"][max(table["attention"], key=float)]),
        ("MLP half, all neurons", table["mlp"][max(table["mlp"], key=float)]),
        ("block, 1/8 of its tokens active (early exit)", _at(table["exit"], 0.125)),
        ("block, capacity 1/8 (Mixture of Depths)", _at(table["mod"], 0.125)),
        ("embedding", table["embedding"]),
        ("head + loss (vocabulary " + f"{s['vocab']})", table["head"]),
    ]
    lines = [
        f"hidden {s['hidden']}, {s['heads']} heads, sequence {s['seq']}, micro-batch {s['micro_batch']}, "
        f"{table['threads']} threads; dense block forward at {block_gflops(dict(table)):.0f} GFLOP/s.",
        "",
        "| layer | forward | backward |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {1e3 * c['fwd']:.0f} ms | {1e3 * c['bwd']:.0f} ms |" for name, c in rows]
    return lines


def _at(axis: Mapping[str, Any], value: float) -> Mapping[str, float]:
    return axis[min(axis, key=lambda k: abs(float(k) - value))]
