"""The straggler benchmark's one results file and its tables (issue 47).

Two parts write their own files: the real A/B on this machine's two processes (:mod:`.straggler_real`) and the
simulated sweep at 8-32 stages (:mod:`.straggler_sim`). :func:`merge` puts their rows into
``docs/bench/straggler.json`` (``real`` rows ``{case, policy, over_uniform, ci95, share_of_ideal}``, ``simulated``
rows ``{n_stages, speed, pattern, dynamic, over_uniform, over_static_time, share_of_oracle, moves_per_event}`` and
the commands that made them); :func:`tables` renders what ``docs/benchmarks.md`` shows of it, so the page's numbers
are the file's (``tests/bench/test_straggler.py`` holds them equal).

``python -m dynmo_lightning.bench.straggler merge --real R.json --simulated S.json --out docs/bench/straggler.json``;
``python -m dynmo_lightning.bench.straggler table docs/bench/straggler.json`` prints the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dynmo_lightning.plots import DASH, TIMES


def merge(real: Mapping[str, Any] | None, simulated: Mapping[str, Any] | None) -> dict[str, Any]:
    """One results file from the parts' files (either may be missing: its rows are then absent)."""
    out: dict[str, Any] = {"commands": {}}
    for name, part in (("real", real), ("simulated", simulated)):
        if part is None:
            continue
        out[name] = part[name]
        out["commands"][name] = part.get("command")
        for key in ("config", "settings"):
            if key in part:
                out.setdefault("settings", {})[name] = part[key]
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}{TIMES}"


def real_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The real A/B: every case and policy over uniform with its 95 % interval, and DynMo's share of the ideal."""
    lines = ["| case | policy | over uniform | 95 % interval | share of the ideal |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        ci = r.get("ci95") or [None, None]
        interval = "-" if ci[0] is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
        share = "-" if r.get("share_of_ideal") is None else f"{100 * r['share_of_ideal']:.0f} %"
        lines.append(f"| {r['case']} | {r['policy']} | {_x(r['over_uniform'])} | {interval} | {share} |")
    return lines


def simulated_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The sweep by stages, speed and pattern, over the dynamics.

    DynMo's range over uniform and over ``static_time``, its least share of the oracle and its most moves per
    straggler event.
    """
    groups: dict[tuple[int, float, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["n_stages"], r["speed"], r["pattern"]), []).append(r)
    lines = [
        "| stages | speed | pattern | DynMo over uniform | over `static_time` | least share of the oracle "
        "| most moves per event |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (n, speed, pattern), group in sorted(groups.items()):
        over = [g["over_uniform"] for g in group]
        static = [g["over_static_time"] for g in group]
        share = min(g["share_of_oracle"] for g in group)
        moves = max(g["moves_per_event"] for g in group)
        lines.append(
            f"| {n} | {speed} | {pattern} | {min(over):.2f}{DASH}{max(over):.2f}{TIMES} "
            f"| {min(static):.2f}{DASH}{max(static):.2f}{TIMES} "
            f"| {100 * share:.0f} % | {moves:.2f} |"
        )
    return lines


def tables(results: Mapping[str, Any]) -> list[str]:
    """What docs/benchmarks.md shows of ``straggler.json``: the real A/B, then the simulated sweep."""
    lines: list[str] = []
    if results.get("real"):
        lines += [*real_table(results["real"]), ""]
    if results.get("simulated"):
        lines += simulated_table(results["simulated"])
        shares = [r["share_of_oracle"] for r in results["simulated"]]
        lines += ["", f"DynMo's share of the oracle over all {len(shares)} simulated rows: least "
                  f"{100 * min(shares):.0f} %, median {100 * statistics.median(shares):.0f} %."]  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """``merge`` the parts' files into one, or print the ``table`` of one."""
    parser = argparse.ArgumentParser(prog="python -m dynmo_lightning.bench.straggler")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--real", type=Path)
    m.add_argument("--simulated", type=Path)
    m.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.command == "merge":
        parts = [json.loads(p.read_text()) if p is not None else None for p in (args.real, args.simulated)]
        args.out.write_text(json.dumps(merge(*parts), indent=1) + "\n")
    else:
        print("\n".join(tables(json.loads(args.path.read_text()))))


if __name__ == "__main__":
    main()
