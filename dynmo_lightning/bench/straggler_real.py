"""Real A/B of a slow process (issue 47): ``uniform``, ``static_time`` and DynMo alternated on this machine's ranks.

A pipeline runs at the pace of its slowest process, so a process that gets slow mid-run is imbalance too. Each case
trains the reference GPT of ``dynmo-bench``'s ``real`` part (no dynamic) on 2 CPU processes while
:class:`~dynmo_lightning.bench.faults.SlowProcess` makes rank 1 take 1.5 times as long from step 20 on:

* ``steady``: slow from step 20 to the end;
* ``intermittent``: slow for ``period`` steps, then fast for ``period`` steps, and so on;
* ``early_exit_late`` (``--early-exit``): no straggler, token early exit ramped *after* the balancer's first check,
  so that ``static_time`` plans on dense costs and only re-planning follows the exits (the committed ``real.json``
  ramps exits before the first check: its ``static_time`` already plans on exiting costs, and the A/B measures
  early exit's static split, not its dynamic part).

Every repeat runs every case under ``uniform``, ``static_time`` and ``optimal`` (DynMo) one after the other (A B C A
B C ...), all in one set of processes (:func:`~dynmo_lightning.bench.real.worker`), so that drift of the machine
falls on every policy. Per case and policy: tokens/s over the window ``[measure_from, steps)``, tokens/s over
uniform's paired repeat by repeat with a 95 % interval, and the share of the ideal: the mean ratio over the ideal
ratio (:func:`speed_ideal`), the makespan of the uniform split over the best split's from the DynMo runs' window
costs at the reference speed and every profiled step's measured speeds (an ideal that re-plans at every step for
free; summed over the window's samples, so that intermittent slow and fast phases weigh as long as they last).

Why these settings (the ``real`` part's model, data, micro-batches and balancer, except its check interval; run
lengths and windows chosen for the straggler at step 20):

* ``every_n_steps`` 10 (not 25): ``static_time`` plans once at the first check, step 10 - *before* the straggler
  appears at step 20, as a split balanced at start-up would; with 25 it would plan after step 20 and see the
  straggler. DynMo profiles every ``every_n_steps // 5`` = 2 steps, and a change of the measured speeds is an event
  it checks at once: two slow kernel timings flip the median of 3, so it moves ~4 steps after the onset.
* ``period`` 20: five times that reaction (each phase is mostly balanced for its speed, not spent catching up) and
  two check intervals; a period of the order of the reaction would have DynMo chase every phase a few steps late,
  which no re-planning policy can win.
* 60 steps. ``steady`` is measured over ``[30, 60)``: ten steps after the onset (DynMo has moved). ``intermittent``
  over ``[20, 60)``: one whole cycle from the onset (slow 20-39, fast 40-59), so both phases weigh as they last;
  every cycle holds the same two reactions (to a slow and to a fast phase), the first one included, and DynMo
  enters it with the split it holds after any fast phase.
* ``early_exit_late``: exits from step 20, the threshold ramped over 15 steps (after ``static_time``'s plan at step
  10, which sees dense costs), 70 steps measured over ``[50, 70)``: the step time settles within ~5 steps of the
  ramp's end (``docs/bench/real``) and the tracker's moving median (5 profiles, 10 steps) follows by step 45.

Cost: a step of the ``real`` model (``n_embd`` 256) takes ~2.0 s on this 2-core machine when it is quiet (the
committed ``docs/bench/real``), ~3.6 s when other work shares it, ~1.3-1.4x that when slowed; with 20 steps before
the onset no shorter run holds the design, so the straggler A/B (30 runs) takes ~75 min quiet, and
``--early-exit`` (15 runs, cheaper steps once tokens exit) ~25 min. ``--set model.n_embd=128`` (~1.2 s a step when
shared, ~0.7 s quiet) brings the straggler A/B to ~26 min; the slowdown's per-op overhead
(:mod:`~dynmo_lightning.bench.faults`) then weighs a little more, which the measured speeds show.

Run: ``python -m dynmo_lightning.bench.straggler_real --out DIR`` (``--help`` for the options); writes
``DIR/straggler_real.json`` (``{"command": [...], "config": {"cases": {label: spec, its command and real config}},
"cases", "link", "real": rows}``) and every case's result file under ``DIR/straggler_real/``. A later run with
other cases into the same ``DIR`` (``--early-exit``) keeps the rows of the cases it did not run.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from dynmo_lightning.bench import read_json, real, write_json
from dynmo_lightning.bench.faults import parse_straggler

#: The policies, in the order they alternate within every repeat.
POLICIES = ("uniform", "static_time", "optimal")
#: The cases :func:`case_specs` defines.
CASES = ("steady", "intermittent", "early_exit_late")
#: Where the per-case results, the spec and the link go (``DIR/straggler_real/``, beside ``DIR/straggler_real.json``
#: as ``real/`` beside ``real.json``), and the logs' tag (``DIR/logs/straggler_real.rank*.log``).
STEM = "straggler_real"
#: The results' file in ``DIR``.
RESULT = "straggler_real.json"
#: What the issue's A/B needs of the ``real`` config: the check interval (see the module's docstring).
REAL_OVERRIDES = ["balancer.every_n_steps=10"]


def case_specs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every case's dynamic, straggler, run length and window, from the command line's arguments."""
    slow = f"{args.rank}:{args.factor}:{args.onset}"
    early = {"warmup_steps": args.ee_warmup, "ramp_steps": args.ee_ramp}
    return {
        "steady": {"dynamic": "none", "straggler": slow, "steps": args.steps, "measure_from": args.measure_from},
        "intermittent": {"dynamic": "none", "straggler": f"{slow}:intermittent:{args.period}", "steps": args.steps,
                         "measure_from": args.onset if args.cycles_from is None else args.cycles_from},  # cycles
        "early_exit_late": {"dynamic": "early_exit", "preset": early, "steps": args.ee_steps,
                            "measure_from": args.ee_measure_from},
    }  # fmt: skip


def check_spec(label: str, spec: dict[str, Any]) -> None:
    """Raise unless a case's window lies in its run after the straggler's onset, and covers whole cycles.

    Raises:
        ValueError: the window is empty, starts before the onset, or (intermittent) is not a whole number of
            slow-and-fast cycles (one phase would weigh more than the other).
    """
    steps, start = spec["steps"], spec["measure_from"]
    if not 0 <= start < steps:
        raise ValueError(f"case {label}: measure_from={start} must lie in [0, steps={steps})")
    if not spec.get("straggler"):
        return
    slow = parse_straggler(spec["straggler"])
    if start < slow["from_step"]:
        raise ValueError(f"case {label}: the window starts at {start}, before the straggler at {slow['from_step']}")
    cycle = 2 * slow.get("period", 10)
    if slow.get("pattern") == "intermittent" and ((steps - start) % cycle or (start - slow["from_step"]) % cycle):
        raise ValueError(
            f"case {label}: the window [{start}, {steps}) must cover whole slow-and-fast cycles of {cycle} steps "
            f"starting at the onset {slow['from_step']} (measure_from - onset and steps - measure_from multiples)"
        )


def build_cases(
    r: Any, out: Path, specs: dict[str, dict[str, Any]], labels: list[str], repeats: int,
    policies: tuple[str, ...] = POLICIES,
) -> list[dict[str, Any]]:  # fmt: skip
    """The cases of every repeat: per repeat, per case label, ``policies`` in turn (A B C A B C ...).

    Each case is ``dynmo-bench``'s (``main._arm_cases``: what :func:`~dynmo_lightning.bench.real.run_case` reads) with
    the label's run length and window, plus ``case`` (the label), ``straggler`` and ``preset`` (the dynamic's
    overrides), named ``<label>-<policy>-<repeat>`` with its result in ``out/straggler_real/``.

    Args:
        r: the ``real`` config (its model, data, micro-batches, balancer, ...).
        out: the output directory.
        specs: every label's spec (:func:`case_specs`).
        labels: the labels to run, in order.
        repeats: repeats of every case and policy.
        policies: the policies, in their order within a repeat.
    """
    from dynmo_lightning.bench.main import _arm_cases  # Hydra's module: imported when cases are built, not before

    arm = {"dynamics": None, "policies": list(policies), "schedule": "1f1b", "stages_per_rank": 1, "stem": STEM}
    cases = []
    for repeat in range(repeats):
        for label in labels:
            spec = specs[label]
            check_spec(label, spec)
            from dynmo_lightning.bench.main import OmegaConf  # Hydra's module: imported here, not before

            cfg = OmegaConf.create({"real": {**OmegaConf.to_container(r), "steps": spec["steps"],
                                             "measure_from": spec["measure_from"]}})  # fmt: skip
            for case in _arm_cases(cfg, out, {**arm, "dynamics": [spec["dynamic"]]}, repeat):
                name = f"{label}-{case['policy']}-{repeat}"
                extra = {"case": label, "straggler": spec.get("straggler"), "preset": spec.get("preset")}
                cases.append(case | extra | {"name": name, "result": str(out / STEM / f"{name}.json")})
    return cases


# ---------------------------------------------------------------------------------------------------------------------
def summarize(
    cases: list[dict[str, Any]], results: dict[str, dict[str, Any]], link: dict[str, float]
) -> list[dict[str, Any]]:
    """Per case label and policy: tokens/s, over uniform paired by repeat (95 %), the ideal ratio and its share.

    Args:
        cases: the cases (:func:`build_cases`).
        results: every case's result, by case name.
        link: the measured point-to-point link (:func:`~dynmo_lightning.bench.real.measure_p2p`).
    """
    p2p = link["p2p_latency_s"] + link["p2p_bytes"] / link["p2p_bytes_per_s"]
    runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for case in cases:
        runs.setdefault((case["case"], case["policy"]), {})[case["repeat"]] = results[case["name"]]
    labels = list(dict.fromkeys(c["case"] for c in cases))
    rows = []
    for label in labels:
        shape = next(c for c in cases if c["case"] == label)
        dynmo = runs.get((label, "optimal"), {})
        ideals = [i for i in (speed_ideal(run, shape, p2p) for _, run in sorted(dynmo.items())) if i is not None]
        ideal = statistics.fmean(ideals) if ideals else None
        speeds = [s for run in dynmo.values() for s in run.get("window_speeds") or []]
        rows += [_row(label, policy, runs, ideal, ideals, speeds) for policy in POLICIES if (label, policy) in runs]
    return rows


def _row(
    label: str,
    policy: str,
    runs: dict[tuple[str, str], dict[int, dict[str, Any]]],
    ideal: float | None,
    ideals: list[float],
    speeds: list[list[float]],
) -> dict[str, Any]:
    """One row of :func:`summarize` (arguments: its label and policy, every run, the case's ideal and speeds)."""
    mine = runs[(label, policy)]
    ratios = _paired(mine, runs.get((label, "uniform"), {}))
    mean, low, high = real.interval95(ratios) if ratios else (None, None, None)
    over_static = _paired(mine, runs.get((label, "static_time"), {})) if policy != "static_time" else []
    row: dict[str, Any] = {
        "case": label,
        "policy": policy,
        "over_uniform": mean,
        "ci95": [low, high],
        "share_of_ideal": mean / ideal if mean is not None and ideal else None,
        "ratios": ratios,
        "tokens_per_s": [mine[r]["tokens_per_s"] for r in sorted(mine)],
        "ideal_ratio": ideal,
        "ideal_ratios": ideals,
        "mean_speeds": [statistics.fmean(col) for col in zip(*speeds, strict=True)] if speeds else None,
        "val_loss": statistics.fmean(run["val_loss"] for run in mine.values()),
        "moves": [run["moves"] for _, run in sorted(mine.items())],
    }
    if over_static and policy != "uniform":
        s_mean, s_low, s_high = real.interval95(over_static)
        row["over_static_time"] = {"mean": s_mean, "ci95": [s_low, s_high], "ratios": over_static}
    return row


def _paired(runs: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[float]:
    """Tokens/s of ``runs`` over ``base``'s, repeat by repeat (the repeats both ran and measured)."""
    return [runs[r]["tokens_per_s"] / base[r]["tokens_per_s"] for r in sorted(runs)
            if r in base and runs[r].get("tokens_per_s") and base[r].get("tokens_per_s")]  # fmt: skip


def speed_ideal(run: dict[str, Any], shape: dict[str, Any], p2p: float, tolerance: float = 0.1) -> float | None:
    """The ideal ratio of one DynMo run's window: summed uniform makespans over summed best makespans.

    Every profiled step of the window gives the ranks' speeds (its kernel times, fastest 1.0); each is priced with
    the window's mean costs at the reference speed, so that the ideal split follows the speeds step by step (an
    oracle that re-plans for free), and the sums weigh slow and fast phases by their samples. Speeds all within
    ``tolerance`` of the fastest count as alike (kernel noise, as the policy's hysteresis takes it). Without kernel
    times (an older result), the raw window costs and equal speeds.

    Returns:
        The ratio, or ``None`` when the run profiled nothing in its window.
    """
    costs = run.get("window_costs_normalised") or run.get("window_costs")
    if not costs:
        return None
    samples = run.get("window_speeds") or [None]
    memo: dict[tuple[float, ...] | None, tuple[float, float]] = {}
    uniform = best = 0.0
    for speeds in samples:
        key = None if speeds is None or min(speeds) >= 1.0 - tolerance else tuple(speeds)
        if key not in memo:
            memo[key] = real.ideal_makespans(costs, shape["world_size"], shape["microbatches"], p2p,
                                             speeds=None if key is None else list(key))  # fmt: skip
        uniform, best = uniform + memo[key][0], best + memo[key][1]
    return uniform / best


# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m dynmo_lightning.bench.straggler_real", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("/tmp/straggler_real"), help="output directory")
    p.add_argument("--repeats", type=int, default=5, help="repeats of every case and policy (>= 5 for the issue)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=["steady", "intermittent"])
    p.add_argument("--early-exit", action="store_true", help="run only early_exit_late (its rows join the JSON)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="(timing runs)")
    p.add_argument("--steps", type=int, default=60, help="steps of the straggler cases")
    p.add_argument("--measure-from", type=int, default=30, help="steady: first step of the measured window")
    p.add_argument(
        "--cycles-from",
        type=int,
        default=None,
        help="intermittent: first measured step (default the onset; whole cycles to --steps)",
    )
    p.add_argument("--rank", type=int, default=1, help="the slow process")
    p.add_argument("--factor", type=float, default=1.5, help="how many times as long its kernels take")
    p.add_argument("--onset", type=int, default=20, help="the first slow step")
    p.add_argument("--period", type=int, default=20, help="steps of each slow and each fast phase (intermittent)")
    p.add_argument("--ee-warmup", type=int, default=20, help="early_exit_late: steps before exits start")
    p.add_argument("--ee-ramp", type=int, default=15, help="early_exit_late: steps of the threshold's ramp")
    p.add_argument("--ee-steps", type=int, default=70, help="early_exit_late: steps")
    p.add_argument("--ee-measure-from", type=int, default=50, help="early_exit_late: first measured step")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides of dynmo-bench's real config, e.g. balancer.every_n_steps=10 model.n_embd=128",
    )
    p.add_argument("--resume", action="store_true", help="keep the case results already in DIR/straggler_real")
    return p.parse_args(argv)


def real_config(overrides: list[str]) -> Any:
    """``dynmo-bench``'s ``real`` config with :data:`REAL_OVERRIDES`, then ``overrides`` (dotted ``KEY=VALUE``)."""
    from dynmo_lightning.bench.main import (
        _CONF,
        OmegaConf,  # Hydra's module: imported here, not before
    )

    base = OmegaConf.load(_CONF / "config.yaml").real
    return OmegaConf.merge(base, OmegaConf.from_dotlist(REAL_OVERRIDES + list(overrides)))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the A/B (the cases without a result, with ``--resume``) and write ``DIR/straggler_real.json``."""
    from dynmo_lightning.bench.main import _launch

    args = parse_args(argv)
    command = shlex.join([sys.executable, "-m", "dynmo_lightning.bench.straggler_real", *(argv or sys.argv[1:])])
    r, out = real_config(args.set), args.out
    labels = ["early_exit_late"] if args.early_exit else list(dict.fromkeys(args.cases))
    # every label keeps the command and the config it ran with (a later run into DIR may use others)
    from dynmo_lightning.bench.main import OmegaConf  # Hydra's module: imported here, not before

    runs_with = {"command": command, "real": OmegaConf.to_container(r)}
    specs = {k: v | runs_with for k, v in case_specs(args).items() if k in labels}
    cases = build_cases(r, out, specs, labels, args.repeats, tuple(args.policies))
    link = out / STEM / "link.json"
    todo = [c for c in cases if not (args.resume and Path(c["result"]).exists())]
    if todo:
        (out / STEM).mkdir(parents=True, exist_ok=True)
        act = r.data.batch_size // r.microbatches * r.data.block_size * r.model.n_embd * 4
        job = {"bytes": act, "result": str(link)} if not link.exists() else None
        _launch(r.world_size, todo, out, r.timeout, job, STEM)
    results = {c["name"]: read_json(Path(c["result"])) for c in cases}
    summary = _merged(out / RESULT, command, specs, cases, read_json(link))
    summary["real"] = summarize(summary["cases"], results | _kept_results(summary["cases"], results), summary["link"])
    write_json(out / RESULT, summary)
    return summary["real"]


def _merged(
    path: Path, command: str, specs: dict[str, Any], cases: list[dict[str, Any]], link: dict[str, Any]
) -> dict[str, Any]:
    """This run's summary, with the cases of other labels an earlier run into the same file measured."""
    old = read_json(path) if path.exists() else {"config": {"cases": {}}, "cases": []}
    kept = [c for c in old["cases"] if c["case"] not in specs]
    kept_specs = {k: v for k, v in old["config"]["cases"].items() if k in {c["case"] for c in kept}}
    return {
        "command": list(dict.fromkeys([*(v["command"] for v in kept_specs.values()), command])),
        "config": {"cases": kept_specs | specs},
        "cases": kept + cases,
        "link": link,
    }


def _kept_results(cases: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The results of the cases an earlier run measured (read back from their files)."""
    return {c["name"]: read_json(Path(c["result"])) for c in cases if c["name"] not in results}


if __name__ == "__main__":
    for row in main():
        print({k: row[k] for k in ("case", "policy", "over_uniform", "ci95", "share_of_ideal")})
