"""``dynmo-bench``: the five parts of the benchmark run from the Hydra config ``conf/bench/config.yaml``.

See :mod:`dynmo_lightning.bench` for what each part measures and writes. This module is the only one of the benchmark
that needs Hydra; ``python -m dynmo_lightning.bench`` and the console script ``dynmo-bench`` start :func:`main`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dynmo_lightning.bench import layer_costs, read_json, real, real_stem, scale, timeline, timeline_path, write_json
from dynmo_lightning.bench.scale import SEED
from dynmo_lightning.launch import clean_env, run_ranks
from dynmo_lightning.sim import save_trace

#: The benchmark's Hydra config directory (``conf/bench``, shipped inside the package).
_CONF = Path(__file__).resolve().parent.parent / "conf" / "bench"

DYNAMICS = ("freezing", "pruning", "early_exit", "mod", "moe", "sparse_attention")
PARTS = ("layer_costs", "timelines", "real", "scale", "report")
#: The scale part's replays, each one key of a dynamic's entry in ``simulated.json`` (``scale.replays``).
REPLAYS = ("by_stages", "zero_bubble", "bandwidth_sweep", "strength_sweep")


class Progress:
    """Which case, how far, and the time left (linear extrapolation)."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.what, self.t0 = total, 0, what, time.perf_counter()

    def step(self, name: str) -> None:
        """Report one finished case."""
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        line = f"[dynmo-bench] {self.what} {self.done}/{self.total} {name}  {elapsed:.0f}s, ~{left:.0f}s left"
        print(line, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
def measure_layers(cfg: DictConfig, out: Path) -> None:
    """Part 1: the layer cost tables (with ``resume``, a table without the backward's weight parts gains them)."""
    c = cfg.layer_costs
    long_shape = {**c.shape, "seq": c.long_seq}
    tables = (("layer_costs.json", c.shape, layer_costs.PARTS), ("layer_costs_long.json", long_shape, c.long_parts))
    for name, shape, parts in tables:
        kept = read_json(out / name) if cfg.resume and (out / name).exists() else None
        if kept is not None and "wgt" in kept["block"]["trainable"]:
            continue
        t0 = time.perf_counter()
        table = layer_costs.measure(
            layer_costs.LayerShape(**shape),
            parts=list(parts),
            threads=c.threads,
            min_run_time=c.min_run_time,
            device=c.device,
        )
        table["seconds"] = time.perf_counter() - t0
        if kept is not None:  # a table from before the weight split keeps its times and gains the measured shares
            table = layer_costs.graft_weight_parts(kept, table) | {"weight_parts_seconds": table["seconds"]}
        write_json(out / name, table)


def _timeline_runs(cfg: DictConfig) -> list[tuple[str, float | None]]:
    """The runs part 2 records and part 4 replays: no dynamic, and every dynamic at every strength of its sweep."""
    return [("none", None)] + [(d, s) for d in cfg.dynamics for s in timeline.PRESETS[d].sweep]


def record_timelines(cfg: DictConfig, out: Path) -> None:
    """Part 2: every dynamic at every strength of its sweep, and the run without dynamics (separate processes)."""
    jobs = [(d, s) for d, s in _timeline_runs(cfg) if not (cfg.resume and timeline_path(out, d, s).exists())]
    progress = Progress(len(jobs), "timeline")
    config = json.dumps(OmegaConf.to_container(cfg.timeline.model))

    def one(job: tuple[str, float | None]) -> None:
        dynamic, strength = job
        path = timeline_path(out, dynamic, strength)
        cmd = [sys.executable, "-m", "dynmo_lightning.bench", "timeline", dynamic, str(strength), str(path), config]
        log = out / "logs" / f"timeline-{dynamic}-{strength}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            code = subprocess.run(cmd, env=clean_env(), stdout=f, stderr=subprocess.STDOUT, check=False).returncode
        if code != 0:
            raise RuntimeError(f"timeline {dynamic} at {strength} failed (exit {code}); see {log}")
        progress.step(f"{dynamic} {strength}")

    with ThreadPoolExecutor(cfg.timeline.parallel) as pool:
        list(pool.map(one, jobs))


def real_runs(cfg: DictConfig, out: Path) -> None:
    """Part 3: the A/B runs on ``real.world_size`` ranks, policies alternating within every repeat.

    Results go to ``real.json`` and ``real/`` under 1F1B, to ``real_<schedule>.json`` and ``real_<schedule>/`` under
    another schedule, so that the A/B of each schedule sits beside the others in one directory. ``real.also`` adds a
    second arm (another schedule, its own dynamics and policies) run in the same processes and alternated with the
    first within every repeat; its file also holds its DynMo over the first arm's, paired repeat by repeat.
    """
    r = cfg.real
    arms = [_arm(r, r)] + ([_arm(r, r.also)] if r.get("also") else [])
    cases = [case for repeat in range(r.repeats) for arm in arms for case in _arm_cases(cfg, out, arm, repeat)]
    first = arms[0]["stem"]
    link = out / first / "link.json"
    _run_missing(cfg, out, arms, cases, link)
    results = {c["result"]: read_json(Path(c["result"])) for c in cases}
    for k, arm in enumerate(arms):
        # the arms after the first against the first, in the same processes, repeat by repeat
        summary = _arm_summary(r, arm, cases, results, link, first if k > 0 else None)
        write_json(out / f"{arm['stem']}.json", summary)


def _run_missing(
    cfg: DictConfig, out: Path, arms: list[dict[str, Any]], cases: list[dict[str, Any]], link: Path
) -> None:
    """Launch the cases without a result (all of them without ``resume``), and the link's measurement if missing."""
    r = cfg.real
    todo = [c for c in cases if not (cfg.resume and Path(c["result"]).exists())]
    if not todo:
        return
    for arm in arms:
        (out / arm["stem"]).mkdir(parents=True, exist_ok=True)
    act = r.data.batch_size // r.microbatches * r.data.block_size * r.model.n_embd * 4
    job = {"bytes": act, "result": str(link)} if not link.exists() else None
    _launch(r.world_size, todo, out, r.timeout, job, arms[0]["stem"])


def _arm_summary(
    r: DictConfig,
    arm: dict[str, Any],
    cases: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    link: Path,
    first: str | None,
) -> dict[str, Any]:
    """An arm's ``real*.json``: its config, the link, its cases, the summary rows and the migration speeds.

    Args:
        r: the ``real`` config.
        arm: the arm (:func:`_arm`).
        cases: the cases of every arm.
        results: every case's result, by its result file.
        link: the measured link's file.
        first: the first arm's stem, for an arm after it (its ``same_run`` rows); ``None`` for the first arm.
    """
    mine = [c for c in cases if c["stem"] == arm["stem"]]
    config = {**OmegaConf.to_container(r), **{k: arm[k] for k in ("schedule", "stages_per_rank", "dynamics",
                                                                 "policies")}}  # fmt: skip
    config.pop("also", None)
    summary: dict[str, Any] = {"config": config, "link": read_json(link), "cases": mine}
    summary["rows"] = real.summarize(mine, {c["name"]: results[c["result"]] for c in mine}, summary["link"])
    speeds = [results[c["result"]]["migration_bytes_per_s"] for c in mine if "migration_bytes_per_s" in
              results[c["result"]]]  # fmt: skip
    summary["migration_bytes_per_s"] = speeds
    if first is not None:
        summary["same_run"] = {"vs": first, "rows": real.across_arms(cases, results, first, arm["stem"])}
    return summary


def _arm(r: DictConfig, arm: Any) -> dict[str, Any]:
    """An arm of the real part: its schedule (and stem), stages per rank, dynamics and policies."""
    schedule = arm.get("schedule", "1f1b")
    return {
        "schedule": schedule,
        "stages_per_rank": arm.get("stages_per_rank", 1),
        "stem": real_stem(schedule),
        "dynamics": list(arm.get("dynamics", r.dynamics)),
        "policies": list(arm.get("policies", r.policies)),
    }


def _arm_cases(cfg: DictConfig, out: Path, arm: dict[str, Any], repeat: int) -> list[dict[str, Any]]:
    r = cfg.real
    cases = []
    for dynamic in arm["dynamics"]:
        for policy in arm["policies"]:
            name = f"{dynamic}-{policy}-{repeat}"
            cases.append(
                {
                    "name": name, "dynamic": dynamic, "policy": policy, "repeat": repeat, "steps": r.steps,
                    "measure_from": r.measure_from, "microbatches": r.microbatches, "world_size": r.world_size,
                    "accelerator": r.accelerator, "model": OmegaConf.to_container(r.model),
                    "schedule": arm["schedule"], "stages_per_rank": arm["stages_per_rank"], "stem": arm["stem"],
                    "data": OmegaConf.to_container(r.data), "balancer": OmegaConf.to_container(r.balancer),
                    "result": str(out / arm["stem"] / f"{name}.json"),
                }
            )  # fmt: skip
    return cases


def _launch(
    world_size: int, cases: list[dict[str, Any]], out: Path, timeout: float, link: dict | None, stem: str
) -> None:
    """Run ``cases`` back to back in one set of ``world_size`` processes, reporting progress as results appear."""
    spec = out / stem / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "link": link}))
    progress = Progress(len(cases), stem)

    def poll() -> None:
        for case in cases[progress.done :]:
            if not Path(case["result"]).exists():
                break
            progress.step(case["name"])

    argv = [sys.executable, "-m", "dynmo_lightning.bench", "worker", str(spec)]
    codes = run_ranks(world_size, argv, log_dir=out / "logs", tag=stem, timeout=timeout * len(cases), poll=poll)
    if any(c != 0 for c in codes):
        raise RuntimeError(f"benchmark processes failed (exit codes {codes}); see {out / 'logs'}/{stem}.rank*.log")


def simulate(cfg: DictConfig, out: Path) -> None:
    """Part 4: realistic traces of the presets, replayed at scale; bandwidth and strength sweeps.

    Each dynamic is replayed in a process of its own, ``scale.parallel`` at once (the replays are independent).
    ``scale.replays`` names the replays to run (:data:`REPLAYS`); with fewer than all of them (and ``resume``) the
    others, the network and the traces stay as the ``simulated.json`` already there has them, byte for byte.
    """
    replays = list(cfg.scale.get("replays") or REPLAYS)
    unknown = set(replays) - set(REPLAYS)
    if unknown:
        raise ValueError(f"unknown scale.replays {sorted(unknown)}; valid: {list(REPLAYS)}")
    kept = None
    if set(replays) != set(REPLAYS):
        if not (cfg.resume and (out / "simulated.json").exists()):
            raise ValueError(
                f"scale.replays={replays} re-simulates part of simulated.json: it needs resume=true and the file "
                f"in hydra.run.dir ({out})"
            )
        kept = read_json(out / "simulated.json")
    net = scale.Network(**kept["network"]) if kept else network(cfg, out)
    result: dict[str, Any] = kept or {"network": net.__dict__, "stages": list(cfg.scale.stages), "dynamics": {}}
    dynamics = ["none", *cfg.dynamics]
    missing = [str(timeline_path(out, d, s)) for d, s in _timeline_runs(cfg) if not timeline_path(out, d, s).exists()]
    if missing:  # before minutes of replays, not after
        raise FileNotFoundError(f"the scale part replays timelines that are not there (run part timelines): {missing}")
    progress = Progress(len(dynamics), "scale")
    container = OmegaConf.to_container(cfg, resolve=True)
    val_none = read_json(timeline_path(out, "none", None))["val_loss"]
    old = result["dynamics"]
    with ProcessPoolExecutor(max(1, int(cfg.scale.get("parallel", 1)))) as pool:
        futures = {
            d: pool.submit(_simulate_dynamic, container, str(out), d, net, val_none, replays, old.get(d, {}))
            for d in dynamics
        }
        for dynamic in dynamics:
            old[dynamic] = futures[dynamic].result()
            progress.step(dynamic)
    write_json(out / "simulated.json", result)


def _simulate_dynamic(
    container: dict[str, Any],
    out_dir: str,
    dynamic: str,
    net: scale.Network,
    val_none: float,
    replays: list[str],
    kept: dict[str, Any],
) -> dict[str, Any]:
    """One dynamic's ``replays``, the entries not replayed taken from ``kept``.

    The preset at every stage count under 1F1B and, on the same ranks, under every schedule of
    ``scale.zero_bubble``; the bandwidth sweep; the strength sweep.
    """
    cfg, out = OmegaConf.create(container), Path(out_dir)
    preset = timeline.PRESETS.get(dynamic)
    name = "layer_costs_long.json" if dynamic == "sparse_attention" else "layer_costs.json"
    table = layer_costs.CostTable(read_json(out / name))
    strength = preset.preset if preset else None
    preset_timeline = read_json(timeline_path(out, dynamic, strength))
    trace = timeline.realistic_trace(preset_timeline, table)
    trace_path = out / "traces" / f"{dynamic}.jsonl.gz"
    if "by_stages" in replays or not trace_path.exists():  # a partial replay leaves the committed trace as it is
        save_trace(trace, trace_path)
    val = preset_timeline["val_loss"]
    entry: dict[str, Any] = kept or {"strength": strength, "val_loss": val, "val_loss_none": val_none}
    kw = {"microbatches_per_stage": cfg.scale.microbatches_per_stage, "every_n_steps": cfg.scale.every_n_steps}
    if "by_stages" in replays:
        entry["by_stages"] = {str(q): scale.compare(trace, q, net, **kw) for q in cfg.scale.stages}
    if "zero_bubble" in replays and zero_bubble_schedules(cfg):
        entry["zero_bubble"] = _zero_bubble_replays(cfg, trace, net, kw)
    if "bandwidth_sweep" in replays:
        entry["bandwidth_sweep"] = _bandwidth_sweep(cfg, trace, net, kw)
    if preset is not None and "strength_sweep" in replays:
        entry["strength_sweep"] = _strength_sweep(cfg, out, dynamic, preset_timeline, trace, table, net, kw)
        entry["seed_reached"] = scale.seed_reached(entry["strength_sweep"], SEED[dynamic])
    return entry


def _zero_bubble_replays(
    cfg: DictConfig, trace: list[dict[str, Any]], net: scale.Network, kw: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The trace at every stage count under each schedule of ``scale.zero_bubble``, by schedule and stage count."""
    # the same trace and batch on the same ranks under each zero-bubble schedule, two stages per rank
    return {
        schedule: {
            str(q): scale.compare(trace, q, net, policies=_TWO, schedule=schedule, stages_per_rank=2, **kw)
            for q in cfg.scale.stages
        }
        for schedule in zero_bubble_schedules(cfg)
    }


def _bandwidth_sweep(
    cfg: DictConfig, trace: list[dict[str, Any]], net: scale.Network, kw: dict[str, Any]
) -> list[dict[str, Any]]:
    """The trace at ``scale.sweep_stages`` at every migration bandwidth of ``scale.bandwidths``."""
    p = cfg.scale.sweep_stages
    return [
        {"bytes_per_s": bw, **_headline(scale.compare(trace, p, _with_bandwidth(net, bw), policies=_TWO, **kw))}
        for bw in cfg.scale.bandwidths
    ]


def _strength_sweep(
    cfg: DictConfig,
    out: Path,
    dynamic: str,
    preset_timeline: dict[str, Any],
    trace: list[dict[str, Any]],
    table: layer_costs.CostTable,
    net: scale.Network,
    kw: dict[str, Any],
) -> list[dict[str, Any]]:
    """The dynamic at every strength of its sweep, at ``scale.sweep_stages``: the headline and the loss of each.

    Args:
        cfg: the benchmark's config.
        out: the benchmark directory (the timelines).
        dynamic: the dynamic, one with a preset.
        preset_timeline: the timeline at the preset's strength.
        trace: the trace of that timeline.
        table: the layer costs that price the timelines.
        net: the network.
        kw: ``scale.compare``'s micro-batch and balancing-interval arguments.
    """
    preset = timeline.PRESETS[dynamic]
    p, sweep = cfg.scale.sweep_stages, []
    for s in preset.sweep:
        # the preset's own strength is the timeline and trace already at hand
        tl = preset_timeline if s == preset.preset else read_json(timeline_path(out, dynamic, s))
        sweep_trace = trace if s == preset.preset else timeline.realistic_trace(tl, table)
        cmp = scale.compare(sweep_trace, p, net, policies=_TWO, **kw)
        sweep.append({"strength": s, "val_loss": tl["val_loss"], **_headline(cmp)})
    return sweep


#: The policies of the zero-bubble replays and the sweeps.
_TWO = ("uniform", "optimal")


def zero_bubble_schedules(cfg: DictConfig) -> list[str]:
    """The schedules of ``scale.zero_bubble`` (one name or a list; null: none)."""
    schedules = cfg.scale.get("zero_bubble")
    if not schedules:
        return []
    return [schedules] if isinstance(schedules, str) else list(schedules)


def _headline(cmp: dict[str, Any]) -> dict[str, float]:
    return {
        "oracle_speedup": cmp["oracle"]["speedup"],
        "optimal_speedup": cmp["policies"]["optimal"]["speedup"],
        "share_of_oracle": cmp["policies"]["optimal"]["share_of_oracle"],
    }


def _with_bandwidth(net: scale.Network, bandwidth: float) -> scale.Network:
    return scale.Network(net.p2p_latency, net.p2p_bandwidth, bandwidth)


def network(cfg: DictConfig, out: Path) -> scale.Network:
    """The link measured by the real runs and the migration bandwidth their balancer measured (else the config)."""
    summary = out / "real.json"
    if summary.exists():
        data = read_json(summary)
        bw = data["migration_bytes_per_s"]
        return scale.Network(
            data["link"]["p2p_latency_s"], data["link"]["p2p_bytes_per_s"],
            sum(bw) / len(bw) if bw else cfg.scale.migration_bytes_per_s,
        )  # fmt: skip
    return scale.Network(cfg.scale.p2p_latency_s, cfg.scale.p2p_bytes_per_s, cfg.scale.migration_bytes_per_s)


@hydra.main(version_base="1.3", config_path=str(_CONF), config_name="config")
def _bench_main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    unknown = (set(cfg.dynamics) - set(DYNAMICS)) | (set(cfg.parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown dynamics/parts {sorted(unknown)}; valid: {list(DYNAMICS)} / {list(PARTS)}")
    steps = {"layer_costs": measure_layers, "timelines": record_timelines, "real": real_runs, "scale": simulate}
    for part in PARTS[:-1]:
        if part in cfg.parts:
            steps[part](cfg, out)
    if "report" in cfg.parts:
        from dynmo_lightning.bench.page import report_bench

        written = report_bench(out)
        print(f"[dynmo-bench] wrote {out / 'benchmarks.md'} and {len(written)} plots", flush=True)


def main() -> None:
    """Console script ``dynmo-bench`` (and the per-process entries ``worker`` and ``timeline``)."""
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        real.worker(sys.argv[2])
    elif len(sys.argv) > 4 and sys.argv[1] == "timeline":
        dynamic, strength, path = sys.argv[2], sys.argv[3], Path(sys.argv[4])
        config = timeline.TimelineConfig(**json.loads(sys.argv[5])) if len(sys.argv) > 5 else timeline.TimelineConfig()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        data = timeline.record(dynamic, None if strength == "None" else float(strength), config)
        write_json(path, data)
    else:
        _bench_main()


if __name__ == "__main__":
    main()
