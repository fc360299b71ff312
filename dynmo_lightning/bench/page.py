"""The benchmark report: ``benchmarks.md`` and its plots, rebuilt from a ``dynmo-bench`` directory's files alone.

Reads ``layer_costs.json`` (and ``layer_costs_long.json``), ``real.json``, ``simulated.json``, the traces and the
timelines (the cost drift of :mod:`.drift`); runs nothing. :func:`report_bench` is what ``dynmo-bench`` ends with
and what ``dynmo-report DIR`` calls for a benchmark directory. Every number the tables show is in those files; the
headline is DynMo's own policy (``optimal``), beside the oracle, the static splits and the seed's figure, with the
validation loss the dynamic trained to; :func:`front_page_table` is the README's table of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from dynmo_lightning import balance
from dynmo_lightning.bench import NAMES, read_json, real_stem
from dynmo_lightning.bench.drift import drift_section
from dynmo_lightning.bench.layer_costs import block_gflops
from dynmo_lightning.bench.scale import SEED
from dynmo_lightning.plots import DASH, TIMES, figure, plot_stage_lines, save
from dynmo_lightning.sim import load_trace


def _read(path: Path) -> Any:
    """A (gzip-compressed) JSON file or a JSON-lines trace as ``dynmo-bench`` wrote it (``None`` if it is missing)."""
    if not path.is_file():
        return None
    return load_trace(path) if ".jsonl" in path.name else read_json(path)


def _x(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.2f}{TIMES}"


def _pct(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{100 * value:.0f} %"


# --------------------------------------------------------------------------------------------------- tables
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
            opt = f"**{_x(pol['optimal']['speedup'])}** ({_pct(pol['optimal']['share_of_oracle'])})"
            # what re-balancing during training adds to a split balanced once on the first measured costs, and
            # the most any balancer could add to it
            rebalance = " | ".join(_over_static(cmp, run) for run in (pol.get("optimal"), cmp["oracle"]))
            others = " | ".join(_x(pol.get(name, {}).get("speedup")) for name in ("diffusion", "static_time", "params"))
            lines.append(
                f"| {NAMES.get(dynamic, dynamic)}{strength} | {p} | {uniform} | {_x(cmp['oracle']['speedup'])} "
                f"| {opt} | {rebalance} | {others} | {loss} | {_x(SEED.get(dynamic))} |"
            )
    return lines


def _over_static(cmp: Mapping[str, Any], run: Mapping[str, Any] | None) -> str:
    """A run's speed-up over ``static_time`` (profile once, balance once, never move) on the same trace and P."""
    static = cmp["policies"].get("static_time")
    return "—" if static is None or run is None else _x(static["total_time"] / run["total_time"])


#: The front page's names of the presets: the paper's dynamic and where its knob is set.
FRONT_PAGE = {"freezing": "AutoFreeze, percentile {}", "pruning": "global, cubic, {}", "early_exit": "min. depth {}",
              "mod": "capacity {}", "moe": "Switch, capacity {}", "sparse_attention": "coverage {}"}  # fmt: skip


def front_page_table(sim: Mapping[str, Any]) -> list[str]:
    """The README's headline table (and ``docs/performance.md``'s): one row per dynamic's preset, P in each cell.

    DynMo (``optimal``) over the uniform split, over ``static_time`` (profile once, balance once, never move) and
    the oracle over ``static_time`` at every P; DynMo's share of the oracle (its range over P), the validation loss
    and the seed paper's figure.
    """
    dynamics = {d: e for d, e in sim["dynamics"].items() if d in FRONT_PAGE}
    stages = " / ".join(next(iter(sim["dynamics"].values()))["by_stages"])
    none = sim["dynamics"].get("none", {}).get("val_loss", next(iter(dynamics.values()))["val_loss_none"])
    lines = [
        f"| dynamic (preset) | DynMo over uniform, P = {stages} | DynMo over `static_time` "
        f"| oracle over `static_time` | share of the oracle | val loss (none: {none:.3f}) | seed paper |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for dynamic, entry in dynamics.items():
        runs = list(entry["by_stages"].values())
        static = [cmp["policies"]["static_time"]["total_time"] for cmp in runs]
        columns = (
            [cmp["policies"]["optimal"]["speedup"] for cmp in runs],
            [s / cmp["policies"]["optimal"]["total_time"] for s, cmp in zip(static, runs, strict=True)],
            [s / cmp["oracle"]["total_time"] for s, cmp in zip(static, runs, strict=True)],
        )
        share = _percent_range(cmp["policies"]["optimal"]["share_of_oracle"] for cmp in runs)
        label = f"{NAMES[dynamic]} ({FRONT_PAGE[dynamic].format(_strength(entry['strength']))})"
        cells = " | ".join(" / ".join(f"{v:.2f}" for v in values) + TIMES for values in columns)
        lines.append(f"| {label} | {cells} | {share} | {entry['val_loss']:.3f} | {_x(SEED.get(dynamic))} |")
    return lines


def _interval(row: Mapping[str, Any], bold: bool = False) -> str:
    ratio = f"**{_x(row['ratio'])}**" if bold else _x(row["ratio"])
    return f"{ratio} [{row['ratio_low']:.3f}, {row['ratio_high']:.3f}]"


def real_front_page(real: Mapping[str, Any], zbv: Mapping[str, Any] | None = None) -> list[str]:
    """The README's sentences on the real A/B (``real.json``) and, with ``zbv`` (``real_zbv.json``), its ZBV arm.

    DynMo over the uniform split and over ``static_time`` (where that arm ran) per dynamic with 95 % intervals, and
    the share of the ideal ratio; for the ZBV arm DynMo over ZBV's uniform split with its ideal, and DynMo + ZBV over
    DynMo + 1F1B measured in the same processes. A test holds the README to these (whitespace aside).
    """
    return [_real_sentence(real), *(_zbv_sentences(zbv) if zbv else [])]


def _real_sentence(real: Mapping[str, Any]) -> str:
    """The sentence on the first arm: DynMo over uniform and over ``static_time``, and its share of the ideal."""
    cfg = real["config"]
    dynmo = [(r["dynamic"], r) for r in real["rows"] if r["policy"] == "optimal"]
    arms = ", ".join(f"`{p}`" if p != "optimal" else "DynMo" for p in cfg["policies"])
    parts = [f"{NAMES[d]} {_interval(r, bold=True)}" for d, r in dynmo]
    static = [f"{NAMES[d]} {_interval(r['over_static_time'])}" for d, r in dynmo if r.get("over_static_time")]
    share = _percent_range(r["share_of_ideal"] for _, r in dynmo if r.get("share_of_ideal"))
    schedule = cfg.get("schedule", "1f1b").upper()
    text = (
        f"**Real A/B on {cfg['world_size']} CPU ranks** (GPT {cfg['model']['n_layer']} {TIMES} "
        f"{cfg['model']['n_embd']}, {cfg['microbatches']} micro-batches, {schedule}; {arms} alternating, "
        f"{cfg['repeats']} repeats, 95 % intervals): DynMo over uniform, {', '.join(parts)}"
    )
    if static:
        text += f"; over `static_time` (what moving layers during training adds), {', '.join(static)}"
    return f"{text}; {share} of the ideal ratio of the same window."


def _zbv_sentences(zbv: Mapping[str, Any]) -> list[str]:
    """A sentence per dynamic on the ZBV arm: DynMo over ZBV's uniform V, and over DynMo + 1F1B where it ran."""
    same = {(r["dynamic"], r["policy"]): r for r in (zbv.get("same_run") or {}).get("rows", [])}
    lines = []
    for row in (r for r in zbv["rows"] if r["policy"] == "optimal"):
        dynamic, policy = row["dynamic"], row["policy"]
        sentence = (
            f"On {zbv['config']['world_size']} CPU ranks under ZBV, {NAMES[dynamic]}: DynMo over the uniform V "
            f"{_interval(row, bold=True)} ({_pct(row['share_of_ideal'])} of the ideal {_x(row['ideal_ratio'])})"
        )
        if (dynamic, policy) in same:
            sentence += f", DynMo + ZBV over DynMo + 1F1B {_interval(same[(dynamic, policy)])} in the same processes"
        lines.append(sentence + ".")
    return lines


def _percent_range(fractions: Iterable[float]) -> str:
    """``"lo-hi %"`` (an en dash) of the fractions rounded to whole percent (``"n %"`` when they round alike)."""
    kept = [round(100 * f) for f in fractions]
    lo, hi = min(kept), max(kept)
    return f"{lo}{DASH}{hi} %" if lo != hi else f"{lo} %"


def _strength(value: float) -> str:
    """A preset's strength as the front page writes it: a unit fraction as ``1/n``, anything else as a number."""
    exact = Fraction(value).limit_denominator(1024)
    return f"1/{exact.denominator}" if exact.numerator == 1 and exact.denominator > 1 else f"{value:g}"


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
                f"| {NAMES.get(dynamic, dynamic)} | {p} | {_x(onef1b['policies']['optimal']['speedup'])} "
                f"| {_x(base / pol['uniform']['total_time'])} "
                f"| **{_x(dynmo['speedup'])}** ({_pct(dynmo['share_of_oracle'])}) | {_x(zb['oracle']['speedup'])} "
                f"| {_x(base / dynmo['total_time'])} | {dynmo['n_migrations']} |"
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
            f"reaches the seed's {_x(SEED[dynamic])} at {PRESETS[dynamic].strength} {reached['strength']}"
            if reached["reached"]
            else f"stays below the seed's {_x(SEED[dynamic])}: at most {_x(reached['oracle_speedup'])} "
            f"({PRESETS[dynamic].strength} {reached['strength']})"
        )
        lines += [f"**{NAMES[dynamic]}** ({PRESETS[dynamic].name}): the oracle {verdict}.", ""]
        lines += [f"| {PRESETS[dynamic].strength} | oracle | DynMo `optimal` | share | val loss |"]
        lines += ["|---:|---:|---:|---:|---:|"]
        for point in sweep:
            lines.append(
                f"| {point['strength']} | {_x(point['oracle_speedup'])} | {_x(point['optimal_speedup'])} "
                f"| {_pct(point['share_of_oracle'])} | {point['val_loss']:.3f} |"
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
        cells = [f"{_x(p['optimal_speedup'])} ({_pct(p['share_of_oracle'])})" for p in sweep]
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
                f"| {NAMES.get(dynamic, dynamic)} | {p} | {_x(repack['speedup'])} "
                f"| {_x(cmp['policies']['optimal']['speedup'])} | {repack['world_size_end']} | {_pct(saved)} |"
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
    static = _interval(run["over_static_time"]) if run.get("over_static_time") else "—"
    return (
        f"| {NAMES.get(dynamic, dynamic)} | {np.mean(uniform['tokens_per_s']):,.0f} | {name} "
        f"| {np.mean(run['tokens_per_s']):,.0f} | {_interval(run, bold=True)} | {static} | {_x(run['ideal_ratio'])} "
        f"| {_pct(run['share_of_ideal'])} | {lag_text} | {run['val_loss']:.3f} |"
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


# --------------------------------------------------------------------------------------------------- plots
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


# --------------------------------------------------------------------------------------------------- the report
def report_bench(directory: str | Path) -> list[Path]:
    """Write ``benchmarks.md`` and ``plots/*.png`` of a ``dynmo-bench`` directory; returns the plots."""
    d = Path(directory)
    costs, sim = (_read(d / name) for name in ("layer_costs.json", "simulated.json"))
    # the real part's A/B of each schedule (``real.json``: 1F1B; ``real_<schedule>.json``), 1F1B first
    reals = [(p.stem, _read(p)) for p in sorted(d.glob("real*.json"), key=lambda p: (p.stem != "real", p.stem))]
    plots: list[Path] = []
    lines = [
        "# DynMo benchmarks",
        "",
        "Rebuilt by `dynmo-report` from the files of this directory alone (`dynmo-bench hydra.run.dir=docs/bench "
        "resume=true` regenerates them). A reading guide: [`../benchmarks.md`](../benchmarks.md).",
        "",
    ]
    if costs:
        lines += ["## Machine", "", ", ".join(f"{k} {v}" for k, v in costs["machine"].items()), ""]
    if sim:
        lines += [*_scale_section(sim), *_front_page_section(sim), *drift_section(d, sim)]
        plots += _scale_plots(sim, d)
    for stem, real in reals:
        if real:
            lines += _real_section(real)
            plots.append(plot_real(real, d / "plots" / f"{stem}.png"))
    if costs:
        lines += ["## Layer costs at LLM size", "", *layer_table(costs), ""]
    lines += ["## Plots", "", *(f"![{p.stem}](plots/{p.name})" for p in plots), ""]
    (d / "benchmarks.md").write_text("\n".join(lines))
    return plots


def _scale_section(sim: Mapping[str, Any]) -> list[str]:
    net = sim["network"]
    first = next(iter(next(iter(sim["dynamics"].values()))["by_stages"].values()))
    per_stage = first["n_microbatches"] // first["n_stages"]
    stages = [int(p) for p in next(iter(sim["dynamics"].values()))["by_stages"]]
    return [
        f"## DynMo at scale: realistic traces, {min(stages)} to {max(stages)} stages",
        "",
        "Each dynamic's layer-state timeline (a 62-block GPT trained with the preset) priced with the layer costs "
        f"measured below; 1F1B with {per_stage} micro-batches per stage; an activation hop takes "
        f"{1e3 * net['p2p_latency']:.2f} ms + bytes at {net['p2p_bandwidth'] / 1e9:.2f} GB/s, layers migrate at "
        f"{net['migration_bandwidth'] / 1e9:.2f} GB/s (all measured on this machine). Speed-ups are over the uniform "
        "split (Megatron-LM's); the oracle re-splits makespan-optimally at every step, for free. Every step time, "
        "decision and oracle split comes from the makespan of 1F1B's own task order (`balance.makespan`). The "
        "uniform split gives every stage the same number of blocks and leaves the embedding and the vocabulary head on "
        "the end stages, so a split balanced once on measured costs (`static_time`) already beats it without any "
        "dynamic; the column *DynMo over `static_time`* is what re-balancing during training adds to that.",
        "",
        *headline_table(sim),
        "",
        *_zero_bubble_section(sim),
        "### Strength sweeps: where the seed's figure is reached",
        "",
        *_stale_note(sim),
        *sweep_table(sim),
        "### Migration bandwidth (clusters)",
        "",
        *_stale_note(sim),
        *bandwidth_table(sim),
        "",
        "### Consolidation",
        "",
        "`optimal+repack` packs the layers onto fewer ranks when their makespan stays within the balancer's repack "
        "tolerance (5 % of the full pipeline's best makespan by default) and releases the rest to the cluster; it "
        "takes them back (a grow) when the full pipeline is more than the tolerance faster again. Rank-seconds are "
        "the ranks held times the time taken, against the uniform split on all P ranks.",
        "",
        *repack_table(sim),
        "",
    ]


def _front_page_section(sim: Mapping[str, Any]) -> list[str]:
    return [
        "### The front page's table",
        "",
        "The presets of the table above as `README.md` and `docs/performance.md` show them (a test holds them to this "
        "file): DynMo over uniform, what re-balancing during training adds to `static_time`'s split, and the most "
        "any balancer could add to it (the oracle).",
        "",
        *front_page_table(sim),
        "",
    ]


def _zero_bubble_section(sim: Mapping[str, Any]) -> list[str]:
    runs = next((e["zero_bubble"] for e in sim["dynamics"].values() if e.get("zero_bubble")), {})
    if not runs:
        return []
    first = next(iter(next(iter(runs.values())).values()))
    lines = [
        f"### Zero-bubble pipelines ({', '.join(f'`{s}`' for s in runs)})",
        "",
        f"The same traces on the same P ranks and the same {first['n_microbatches'] // first['n_ranks']} "
        "micro-batches per rank, under each zero-bubble schedule: two stages per rank, in a V for `zbv` and "
        "`dualpipev` (stages s and 2P - 1 - s on rank s), looped for `interleaved_zb` (stages s and P + s), the "
        "backward split into its input-gradient and weight-gradient tasks (the weight part of every layer measured "
        "below). Zero-bubble speed-ups are over the uniform split under the same schedule; the last columns put the "
        "schedule and the balancing together over 1F1B's uniform split.",
        "",
    ]
    for schedule, by_ranks in runs.items():
        title, order = SCHEDULE_NAMES.get(schedule, (schedule, schedule))
        lines += [f"#### {title} (`{schedule}`, `{order}`)", ""]
        note = _one_layer_note(by_ranks).strip()
        lines += [note, ""] if note else []
        lines += [*zero_bubble_table(sim, schedule), ""]
    return lines


def _one_layer_note(by_ranks: Mapping[str, Any]) -> str:
    """A sentence on the stage counts at which every stage holds one layer (nothing left to balance)."""
    full = [(p, cmp["n_stages"]) for p, cmp in by_ranks.items()
            if sum(cmp["policies"]["uniform"]["partitions"][0][1]) <= cmp["n_stages"]]  # fmt: skip
    return "".join(f" At P = {p} the {n} stages hold one layer each: no split is left to choose." for p, n in full)


def _scale_plots(sim: Mapping[str, Any], d: Path) -> list[Path]:
    plots = [plot_speedups(sim, d / "plots" / "speedup.png")]
    sweeps = plot_sweeps(sim, d / "plots" / "sweeps.png")
    plots += [sweeps] if sweeps else []
    stages = [str(p) for p in sim.get("stages", [])]
    p = stages[len(stages) // 2] if stages else None
    for dynamic, entry in sim["dynamics"].items():
        trace = _read(d / "traces" / f"{dynamic}.jsonl.gz")
        if trace and p in entry["by_stages"]:
            path = d / "plots" / f"stage_loads_{dynamic}_P{p}.png"
            plots.append(plot_stage_loads(trace, entry["by_stages"][p], dynamic, path))
    return plots


#: Section titles and torch's schedule classes of the real part's schedules.
SCHEDULE_NAMES = {
    "1f1b": ("1F1B", "Schedule1F1B"),
    "gpipe": ("GPipe", "ScheduleGPipe"),
    "interleaved_1f1b": ("interleaved 1F1B", "ScheduleInterleaved1F1B"),
    "interleaved_zb": ("interleaved zero-bubble", "ScheduleInterleavedZeroBubble"),
    "zbv": ("zero-bubble V (ZBV)", "ScheduleZBVZeroBubble"),
    "dualpipev": ("DualPipeV", "ScheduleDualPipeV"),
}


def _real_section(real: Mapping[str, Any]) -> list[str]:
    link, cfg = real["link"], real["config"]
    hop = 1e3 * (link["p2p_latency_s"] + link["p2p_bytes"] / link["p2p_bytes_per_s"])
    schedule, per_rank = cfg.get("schedule", "1f1b"), cfg.get("stages_per_rank", 1)
    title, order = SCHEDULE_NAMES.get(schedule, (schedule, schedule))
    stages = f" x {per_rank} stages" if per_rank > 1 else ""
    return [
        f"## Real A/B on this machine: {title}",
        "",
        f"{cfg['world_size']} ranks{stages}, GPT {cfg['model']['n_layer']} blocks x {cfg['model']['n_embd']}, "
        f"batches of {cfg['data']['batch_size']} x {cfg['data']['block_size']} tokens in {cfg['microbatches']} "
        f"micro-batches, {cfg['steps']} steps, tokens/s from step {cfg['measure_from']}; {cfg['repeats']} repeats, "
        f"policies alternating; one activation hop {hop:.2f} ms. Ratio: a policy's tokens/s over the uniform run "
        "beside it (and over the `static_time` run, profiled and balanced once, where it ran). Ideal: the uniform "
        f"split's step time over the best split's, both the makespan of `{order}`'s task order "
        "(`balance.StepModel`) from the per-layer costs DynMo's balancer measured in the same window.",
        "",
        *real_table(real),
        "",
        *_same_run_table(real),
    ]


def _same_run_table(real: Mapping[str, Any]) -> list[str]:
    """This arm against the one it alternated with in the same processes (``real.also``), repeat by repeat."""
    same = real.get("same_run")
    if not same or not same["rows"]:
        return []
    # the other arm's schedule, from the name of its results (bench.real_stem)
    other = next((title for name, (title, _) in SCHEDULE_NAMES.items() if real_stem(name) == same["vs"]), same["vs"])
    lines = [
        f"In the same processes, alternated with the `{other}` arm in every repeat: this schedule's tokens/s over "
        f"that one's, paired by repeat (95 % intervals).",
        "",
        "| dynamic | policy | over the other schedule [95 % interval] |",
        "|---|---|---:|",
    ]
    for row in same["rows"]:
        name = "DynMo" if row["policy"] == "optimal" else f"`{row['policy']}`"
        lines.append(f"| {NAMES.get(row['dynamic'], row['dynamic'])} | {name} | {_interval(row, bold=True)} |")
    return [*lines, ""]


def _stale_note(sim: Mapping[str, Any]) -> list[str]:
    """A line under a sweep the results file says was simulated with an earlier step-time model."""
    note = sim.get("step_model", {}).get("sweeps")
    return [f"*Not re-simulated yet: {note}.*", ""] if note else []
