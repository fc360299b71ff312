"""A slow process in a simulated pipeline at scale: DynMo against static splits, its speed-blind self and the oracle.

Issue 47: a slow device is imbalance too. Every row replays one realistic cost trace (``docs/bench/traces``) through
:func:`~dynmo_lightning.sim.simulate_run` with one process of the pipeline slowed, on the network the benchmark
measured (``docs/bench/simulated.json``) and with the scale part's settings (``conf/bench/config.yaml``: 1F1B,
``microbatches_per_stage`` micro-batches per rank, a check every ``every_n_steps`` steps). Replayed with the same trace
and the same true speeds:

* ``uniform``: layers split by count (Megatron-LM's), never changed: the speed-ups' reference;
* ``static_time``: planned once from the first check's profile, before the straggler appears (it keeps the split it
  found then: on the ``none`` trace the uniform one);
* DynMo: ``optimal`` with the balancer's default settings (``process_speeds=True``: it estimates every process's
  speed from its calibration-kernel times and re-plans when one leaves the ``speed_tolerance`` band);
* the speed-blind DynMo of before: the same with ``process_speeds=False`` (a slow process makes its own layers
  look expensive, and that cost travels with a layer it moves), reported as ``blind_*``;
* the oracle (:func:`~dynmo_lightning.bench.scale.oracle`): every step on the makespan-optimal split for its costs
  and the true speeds, moved to for free.

The straggler, and why so:

* **which process**: the middle rank (``n_ranks // 2``). Its stage has neighbours on both sides, so layers can leave
  it either way; the first and last stages hold the embedding and the head and the pipeline's fill and drain, which
  would mix a second effect into the numbers.
* **when**: from a fifth into the trace (step ``n_steps // 5``: 60 of 300). By then the balancer has run several
  checks, so it is the *onset* that is measured, not a slow start that the first plan absorbs for free.
* **intermittent**: :data:`PERIOD_CHECKS` check intervals slow, as many at full speed, and so on (40 steps each at
  the bench's 10): long enough to be a straggler that comes and goes (a thermal throttle, a noisy neighbour) rather
  than noise the speed hysteresis should ignore, and long enough that a move made a few steps into a window can
  still earn back its migration - while still changing several times in one run (6 events in 300 steps).
* **steady**: slow from the onset to the end (1 event).
* **how slow**: ``speed`` in (0.5, 0.7, 0.9), the true relative speed (0.5: twice as slow). Only this process slows;
  the schedule is :func:`~dynmo_lightning.bench.faults.slow_at`'s, the one the real runs'
  :class:`~dynmo_lightning.bench.faults.SlowProcess` follows.

Row fields (:data:`ROW_KEYS`): ``over_uniform`` and ``over_static_time`` are those policies' total time over
DynMo's (> 1: DynMo is faster); ``share_of_oracle`` is DynMo's speed-up over uniform divided by the oracle's
(:func:`~dynmo_lightning.bench.scale._share`); ``n_events`` counts the steps where the straggler's speed changes
(:func:`events`: onset, recovery, onset, ...); ``n_migrations`` counts DynMo's partition changes in the whole run,
those the dynamic causes included; ``moves_per_event`` is ``max(0, n_migrations - m0) / n_events``, where ``m0`` is
the partition changes of the same DynMo on the same trace with no straggler: the moves the straggler caused, per
change of its speed (the dynamic's own moves subtracted). It is a net count: a check that the straggler and the
dynamic both call for moves once and counts for neither, and a straggler that spares a move the dynamic would have
made counts as 0, not below. ``blind_over_uniform`` and ``blind_share_of_oracle`` are the same numbers for the
speed-blind DynMo.

Run time: the replays and the oracle cost about the same for every *distinct* step of a trace. The ``none``,
freezing, pruning and early-exit traces hold few (1 to 16 in 300 steps); Mixture of Depths, MoE and sparse attention
change costs at nearly every step (101 to 300), and their oracle plans each step again (about 0.9 s a step at 32
stages; a 32-stage MoE row took 6 minutes on every step). So those three are replayed on every
``STRIDE[dynamic]``-th step of their trace (``settings.stride`` and ``settings.n_steps`` say so), with the straggler
laid on the replayed steps as on any trace: onset a fifth in (step 12 of 60, 20 of 100), windows of 40 replayed steps
(2 events instead of 6 when intermittent). Each replayed step stands for ``stride`` trained steps, so this
*understates* DynMo there: what costs it a fixed number of steps (the steps on the uniform split before the first
check, the steps before it sees a speed change) weighs ``stride`` times more in a run that much shorter, and the
dynamic drifts that much faster against the checks (MoE at 16 stages, speed 0.5: a share of the oracle of 0.93 on
every 5th step, 0.98 on every step). A dynamic's events (``changed_layers``) on a dropped step are kept on the next
kept one.

``python -m dynmo_lightning.bench.straggler_sim --out PATH`` writes ``{"command", "simulated": rows, "settings"}``
(default ``/tmp/straggler_sim.json``); ``--every-step`` replays every step of every trace (hours on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import resource
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dynmo_lightning.bench import read_json, write_json
from dynmo_lightning.bench.faults import PATTERNS, slow_at
from dynmo_lightning.bench.scale import Network, _share, oracle
from dynmo_lightning.sim import load_trace, simulate_run

#: Where the benchmark's results and traces are (the repository's copy).
BENCH_DIR = Path(__file__).resolve().parents[2] / "docs" / "bench"
#: The benchmark's configuration (stage counts, micro-batches, the check interval, the dynamics).
CONFIG = Path(__file__).resolve().parent.parent / "conf" / "bench" / "config.yaml"
#: The straggler's true speeds swept (1 is the reference; 0.5 takes twice as long).
SPEEDS = (0.5, 0.7, 0.9)
#: Check intervals in each slow and each normal window of the intermittent straggler.
PERIOD_CHECKS = 4
#: The straggler starts this far into the (replayed) trace.
START_FRACTION = 0.2
#: Every how many steps of a trace are replayed (1: all): the traces whose costs change at nearly every step.
STRIDE = {"mod": 3, "moe": 5, "sparse_attention": 5}
#: The keys of a row, in order.
ROW_KEYS = (
    "n_stages", "speed", "pattern", "dynamic", "over_uniform", "over_static_time", "share_of_oracle",
    "moves_per_event", "n_events", "n_migrations", "blind_over_uniform", "blind_share_of_oracle",
)  # fmt: skip


def straggler_speeds(
    n_ranks: int, rank: int, speed: float, pattern: str, start: int, period: int
) -> Callable[[int], list[float]]:
    """Every process's true speed at each trace step: all 1 but ``rank``, slowed to ``speed`` from ``start`` on.

    Args:
        n_ranks: processes of the pipeline.
        rank: the slow one.
        speed: its relative speed while slow, in (0, 1] (0.5: twice as slow).
        pattern: ``"steady"`` (slow from ``start`` to the end) or ``"intermittent"`` (``period`` steps slow,
            ``period`` at full speed, and so on).
        start: the first slow trace step.
        period: the length of each slow and each normal window of ``"intermittent"``.

    Returns:
        ``speeds(k)``: the ``n_ranks`` speeds during trace step ``k``, as :func:`~dynmo_lightning.sim.simulate_run`
        and :func:`~dynmo_lightning.bench.scale.oracle` take them.

    Raises:
        ValueError: a rank outside the pipeline, a speed outside (0, 1], an unknown pattern, a negative start or a
            period below 1.
    """
    _check(n_ranks, rank, speed, pattern, start, period)

    def speeds(k: int) -> list[float]:
        out = [1.0] * n_ranks
        if slow_at(k, start, pattern, period):
            out[rank] = speed
        return out

    return speeds


def events(n_steps: int, start: int, pattern: str, period: int) -> list[int]:
    """The trace steps (of ``n_steps``) at which the straggler's speed changes: onset, recovery, onset, ...

    Arguments as :func:`straggler_speeds`'s; a step is an event when it is slow and the one before was not, or the
    other way round (the straggler is at full speed before step 0).
    """
    _check(1, 0, 0.5, pattern, start, period)
    slow = [slow_at(k, start, pattern, period) for k in range(n_steps)]
    return [k for k in range(n_steps) if slow[k] != (slow[k - 1] if k else False)]


def _check(n_ranks: int, rank: int, speed: float, pattern: str, start: int, period: int) -> None:
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank={rank} must be a rank of the {n_ranks}-rank pipeline")
    if not 0 < speed <= 1:
        raise ValueError(f"speed={speed} must be in (0, 1] (1: full speed; 0.5: twice as slow)")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} must be one of {PATTERNS}")
    if start < 0 or period < 1:
        raise ValueError(f"start={start} must be >= 0 and period={period} >= 1 step")


def every_kth(trace: Sequence[Mapping[str, Any]], k: int) -> list[dict[str, Any]]:
    """Every ``k``-th step of ``trace`` (the first one included); the events of a dropped step move to the next kept.

    A dynamic's event (``changed_layers``: layers it changed just before a step) that fell on a dropped step would
    otherwise be lost, and the balancer would never restart those layers' history.
    """
    if k < 1:
        raise ValueError(f"stride {k} must be >= 1")
    out, pending = [], set()
    for i, entry in enumerate(trace):
        pending.update(entry.get("changed_layers") or ())
        if i % k == 0:
            kept = dict(entry)
            if "changed_layers" in entry or pending:
                kept["changed_layers"] = sorted(pending)
            out.append(kept)
            pending = set()
    return out


class Replay:
    """One trace replayed at one stage count with the bench's settings: what every run of a row shares.

    Args:
        trace: the cost trace.
        n_stages: pipeline stages (one per rank).
        network: the links (activation hops and migrations).
        microbatches_per_stage: micro-batches per step over the ranks.
        every_n_steps: steps between the balancer's checks.
    """

    def __init__(
        self,
        trace: Sequence[Mapping[str, Any]],
        n_stages: int,
        network: Network,
        microbatches_per_stage: int,
        every_n_steps: int,
    ) -> None:
        self.trace = [dict(e) for e in trace]
        self.n_stages = n_stages
        self.every_n_steps = every_n_steps
        self.n_microbatches = microbatches_per_stage * n_stages
        self.p2p = network.p2p(self.trace[0]["activation_bytes"][0])
        self.bandwidth = network.migration_bandwidth

    def run(self, policy: str, speeds: Callable[[int], Sequence[float]] | None = None, **settings: Any) -> Any:
        """:func:`~dynmo_lightning.sim.simulate_run` of ``policy`` under ``speeds`` (balancer ``settings`` on top)."""
        return simulate_run(
            self.trace, policy, self.n_stages, n_microbatches=self.n_microbatches, p2p=self.p2p,
            every_n_steps=self.every_n_steps, bandwidth=self.bandwidth, schedule="1f1b", stages_per_rank=1,
            speeds=speeds, **settings,
        )  # fmt: skip

    def oracle_time(self, speeds: Callable[[int], Sequence[float]]) -> float:
        """The oracle's total time under the true ``speeds``."""
        best = oracle(self.trace, self.n_stages, n_microbatches=self.n_microbatches, p2p=self.p2p, speeds=speeds)
        return float(best["total_time"])

    def straggler(self, speed: float, pattern: str) -> tuple[Callable[[int], list[float]], list[int]]:
        """The straggler of this module's choices (middle rank, onset, period) and the steps its speed changes."""
        start, period = schedule_of(len(self.trace), self.every_n_steps)
        fn = straggler_speeds(self.n_stages, self.n_stages // 2, speed, pattern, start, period)
        return fn, events(len(self.trace), start, pattern, period)


def schedule_of(n_steps: int, every_n_steps: int) -> tuple[int, int]:
    """``(start, period)`` of the straggler in a trace of ``n_steps`` checked every ``every_n_steps`` steps."""
    return int(n_steps * START_FRACTION), PERIOD_CHECKS * every_n_steps


def no_straggler_migrations(replay: Replay) -> int:
    """DynMo's partition changes on the trace with every process at full speed (what the dynamic alone causes)."""
    return replay.run("optimal").n_migrations


def replay_row(replay: Replay, dynamic: str, speed: float, pattern: str) -> dict[str, Any]:
    """Every policy and the oracle on ``replay``'s trace with one straggler; a row without ``moves_per_event``.

    Returns:
        The row's fields (:data:`ROW_KEYS`) but ``moves_per_event``, which needs the run without a straggler
        (:func:`finish_row`).
    """
    speeds, changes = replay.straggler(speed, pattern)
    uniform = replay.run("uniform", speeds).total_time
    static = replay.run("static_time", speeds).total_time
    dynmo = replay.run("optimal", speeds)
    blind = replay.run("optimal", speeds, process_speeds=False).total_time
    best = replay.oracle_time(speeds)
    oracle_speedup = uniform / best
    return {
        "n_stages": replay.n_stages, "speed": speed, "pattern": pattern, "dynamic": dynamic,
        "over_uniform": uniform / dynmo.total_time, "over_static_time": static / dynmo.total_time,
        "share_of_oracle": _share(uniform / dynmo.total_time, oracle_speedup), "n_events": len(changes),
        "n_migrations": dynmo.n_migrations, "blind_over_uniform": uniform / blind,
        "blind_share_of_oracle": _share(uniform / blind, oracle_speedup),
    }  # fmt: skip


def finish_row(row: Mapping[str, Any], migrations_without: int) -> dict[str, Any]:
    """``row`` with ``moves_per_event``: the moves beyond the no-straggler run's ``migrations_without``, per event."""
    extra = max(0, row["n_migrations"] - migrations_without)
    out = dict(row, moves_per_event=extra / row["n_events"] if row["n_events"] else math.nan)
    return {k: out[k] for k in ROW_KEYS}


def _row_task(
    trace: Sequence[Mapping[str, Any]], dynamic: str, n_stages: int, network: Network, kw: dict[str, Any],
    speed: float, pattern: str,
) -> dict[str, Any]:  # fmt: skip
    return replay_row(Replay(trace, n_stages, network, **kw), dynamic, speed, pattern)


def _baseline_task(trace: Sequence[Mapping[str, Any]], n_stages: int, network: Network, kw: dict[str, Any]) -> int:
    return no_straggler_migrations(Replay(trace, n_stages, network, **kw))


class _Inline:
    """A stand-in for a process pool that runs each task when it is submitted (``parallel=1``: tests, debugging)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def sweep(
    traces: Mapping[str, Sequence[Mapping[str, Any]]],
    network: Network,
    *,
    stages: Iterable[int] = (8, 16, 32),
    speeds: Iterable[float] = SPEEDS,
    patterns: Iterable[str] = PATTERNS,
    microbatches_per_stage: int = 4,
    every_n_steps: int = 10,
    parallel: int = 1,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every row (:data:`ROW_KEYS`): each stage count, straggler speed, pattern and dynamic's trace.

    Args:
        traces: ``{dynamic: trace}`` (already thinned where wanted: :func:`every_kth`).
        network: the links.
        stages: pipeline stage counts (one stage per rank).
        speeds: the straggler's true speeds.
        patterns: ``"steady"`` and/or ``"intermittent"``.
        microbatches_per_stage: micro-batches per step over the ranks.
        every_n_steps: steps between the balancer's checks.
        parallel: processes replaying rows at once (1: in this process).
        log: called with a line as each row is done.

    Returns:
        The rows ordered by stage count, speed, pattern and dynamic (in ``traces``' order).
    """
    kw = {"microbatches_per_stage": microbatches_per_stage, "every_n_steps": every_n_steps}
    keys = [(q, v, p, d) for q in stages for v in speeds for p in patterns for d in traces]
    # The costliest first (more stages, more distinct steps), so that the last tasks left are short ones.
    order = sorted(keys, key=lambda key: -key[0] * _distinct_steps(traces[key[3]]))
    pool: Any = ProcessPoolExecutor(parallel) if parallel > 1 else _Inline()
    with pool:
        base = {(q, d): pool.submit(_baseline_task, traces[d], q, network, kw) for q in stages for d in traces}
        rows = {key: pool.submit(_row_task, traces[key[3]], key[3], key[0], network, kw, key[1], key[2])
                for key in order}  # fmt: skip
        out = []
        for done, key in enumerate(order, 1):
            row = finish_row(rows[key].result(), base[key[0], key[3]].result())
            if log is not None:
                log(f"[straggler_sim] {done}/{len(order)} {_line(row)}")
            out.append(row)
    return sorted(out, key=lambda r: keys.index((r["n_stages"], r["speed"], r["pattern"], r["dynamic"])))


def _distinct_steps(trace: Sequence[Mapping[str, Any]]) -> int:
    return len({(*e["fwd"], *e["bwd"], *e.get("bwd_weight", ())) for e in trace})


def _line(row: Mapping[str, Any]) -> str:
    """A row on one line (the log and the table ``main`` prints)."""
    return (
        f"P={row['n_stages']:>2} v={row['speed']} {row['pattern']:<12} {row['dynamic']:<16} "
        f"xU={row['over_uniform']:.3f} xS={row['over_static_time']:.3f} share={row['share_of_oracle']:.3f} "
        f"moves/ev={row['moves_per_event']:.2f} ev={row['n_events']} mig={row['n_migrations']} "
        f"blind xU={row['blind_over_uniform']:.3f} share={row['blind_share_of_oracle']:.3f}"
    )


def load_traces(directory: Path, dynamics: Iterable[str], stride: Mapping[str, int]) -> dict[str, list[dict]]:
    """``{dynamic: trace}`` from ``directory/<dynamic>.jsonl.gz``, every ``stride[dynamic]``-th step (default 1)."""
    return {d: every_kth(load_trace(directory / f"{d}.jsonl.gz"), stride.get(d, 1)) for d in dynamics}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dynmo_lightning.bench.straggler_sim [--out PATH] [--parallel N]``: the sweep, as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/straggler_sim.json"), help="the JSON to write")
    parser.add_argument("--parallel", type=int, default=2, help="processes replaying rows at once")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="simulated.json and traces/ are here")
    parser.add_argument("--every-step", action="store_true", help=f"replay every step (no {STRIDE}): hours")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    from dynmo_lightning.bench.main import OmegaConf  # Hydra's module: imported here, not before

    cfg = OmegaConf.load(CONFIG).scale
    dynamics = ["none", *OmegaConf.load(CONFIG).dynamics]
    network = Network(**read_json(args.bench_dir / "simulated.json")["network"])
    stride = {d: 1 if args.every_step else STRIDE.get(d, 1) for d in dynamics}
    traces = load_traces(args.bench_dir / "traces", dynamics, stride)
    kw = {"microbatches_per_stage": int(cfg.microbatches_per_stage), "every_n_steps": int(cfg.every_n_steps)}
    stages = [int(q) for q in cfg.stages]
    rows = sweep(traces, network, stages=stages, parallel=args.parallel, log=_print, **kw)
    settings = {
        "stages": stages, "speeds": list(SPEEDS), "patterns": list(PATTERNS), "dynamics": dynamics,
        "schedule": "1f1b", **kw, "network": network.__dict__, "stride": stride,
        "n_steps": {d: len(t) for d, t in traces.items()},
        "straggler": {"rank": "n_ranks // 2", "start": f"int({START_FRACTION} * n_steps)",
                      "intermittent_period": PERIOD_CHECKS * kw["every_n_steps"]},
        "policies": {"dynmo": "optimal, balancer defaults (process_speeds=True)",
                     "blind": "optimal, process_speeds=False", "baselines": ["uniform", "static_time", "oracle"]},
        "moves_per_event": "max(0, DynMo's partition changes - those of DynMo without a straggler) / n_events",
    }  # fmt: skip
    argv_text = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    command = f"python -m dynmo_lightning.bench.straggler_sim {argv_text}".strip()
    write_json(args.out, {"command": command, "simulated": rows, "settings": settings})
    # CPU seconds as well as wall seconds: on a shared machine the wall time says as much about the neighbours
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))  # fmt: skip
    wall = time.perf_counter() - began
    print(f"[straggler_sim] {len(rows)} rows in {wall:.0f} s ({cpu:.0f} CPU s) -> {args.out}", flush=True)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
