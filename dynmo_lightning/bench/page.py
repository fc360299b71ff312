"""The benchmark report: ``benchmarks.md`` and its plots, rebuilt from a ``dynmo-bench`` directory's files alone.

Reads ``layer_costs.json`` (and ``layer_costs_long.json``), ``real.json``, ``simulated.json``, the traces and the
timelines (the cost drift of :mod:`.drift`); runs nothing. :func:`report_bench` is what ``dynmo-bench`` ends with
and what ``dynmo-report DIR`` calls for a benchmark directory. Every number the tables show is in those files; the
headline is DynMo's own policy (``optimal``), beside the oracle, the static splits and the seed's figure, with the
validation loss the dynamic trained to; :func:`front_page_table` is the README's table of it.

This module puts the page together from its parts: the tables (:mod:`.page_tables`), the front page's numbers
(:mod:`.front_page`), the plots (:mod:`.page_plots`) and how a number is written (:mod:`.page_cells`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dynmo_lightning.bench import NAMES, read_json, real_stem
from dynmo_lightning.bench.drift import drift_section
from dynmo_lightning.bench.front_page import FRONT_PAGE, front_page_table, real_front_page
from dynmo_lightning.bench.page_cells import interval
from dynmo_lightning.bench.page_plots import plot_real, plot_speedups, plot_stage_loads, plot_sweeps
from dynmo_lightning.bench.page_tables import (
    bandwidth_table,
    headline_table,
    layer_table,
    real_table,
    repack_table,
    sweep_table,
    zero_bubble_table,
)
from dynmo_lightning.sim import load_trace

__all__ = [
    "FRONT_PAGE",
    "SCHEDULE_NAMES",
    "bandwidth_table",
    "front_page_table",
    "headline_table",
    "layer_table",
    "plot_real",
    "plot_speedups",
    "plot_stage_loads",
    "plot_sweeps",
    "real_front_page",
    "real_table",
    "repack_table",
    "report_bench",
    "sweep_table",
    "zero_bubble_table",
]


def _read(path: Path) -> Any:
    """A (gzip-compressed) JSON file or a JSON-lines trace as ``dynmo-bench`` wrote it (``None`` if it is missing)."""
    if not path.is_file():
        return None
    return load_trace(path) if ".jsonl" in path.name else read_json(path)


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
        lines.append(f"| {NAMES.get(row['dynamic'], row['dynamic'])} | {name} | {interval(row, bold=True)} |")
    return [*lines, ""]


def _stale_note(sim: Mapping[str, Any]) -> list[str]:
    """A line under a sweep the results file says was simulated with an earlier step-time model."""
    note = sim.get("step_model", {}).get("sweeps")
    return [f"*Not re-simulated yet: {note}.*", ""] if note else []
