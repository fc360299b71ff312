"""The front page's numbers: the README's headline table and its sentences on the real A/B, from the results files.

A test holds ``README.md`` and ``docs/performance.md`` to what these write (``tests/test_readme_numbers.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from dynmo_lightning.bench import NAMES
from dynmo_lightning.bench.page_cells import interval, percent, ratio
from dynmo_lightning.bench.scale import SEED
from dynmo_lightning.plots import DASH, TIMES

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
        lines.append(f"| {label} | {cells} | {share} | {entry['val_loss']:.3f} | {ratio(SEED.get(dynamic))} |")
    return lines


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
    parts = [f"{NAMES[d]} {interval(r, bold=True)}" for d, r in dynmo]
    static = [f"{NAMES[d]} {interval(r['over_static_time'])}" for d, r in dynmo if r.get("over_static_time")]
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
            f"{interval(row, bold=True)} ({percent(row['share_of_ideal'])} of the ideal {ratio(row['ideal_ratio'])})"
        )
        if (dynamic, policy) in same:
            sentence += f", DynMo + ZBV over DynMo + 1F1B {interval(same[(dynamic, policy)])} in the same processes"
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
