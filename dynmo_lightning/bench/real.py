"""Real A/B runs on this machine's ranks: the same training under the uniform split and under DynMo, alternated.

Every case trains the reference GPT from the same seed with one dynamic (:data:`REAL_PRESETS`, the presets of
:mod:`~dynmo_lightning.bench.timeline` compressed into a short run) under one policy. The cases of all repeats run
back to back in one set of processes, policies alternating (A B A B ...), so that drift of the machine falls on both.
Measured per case: tokens per second over the window ``[measure_from, steps)``, the per-layer costs the balancer
profiled in that window (from which the makespan of the run's schedule, with the measured point-to-point time,
predicts the ideal ratio of the best split over the uniform one), when the dynamic changed layers and when the
balancer moved them (the reaction lag), and the validation loss. The math of both policies is the same, so are
their losses.

:func:`worker` is one rank (``python -m dynmo_lightning.bench worker SPEC``); :func:`summarize` turns the cases into
ratios with 95 % intervals.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.balance import StepModel, makespan_split, partition
from dynmo_lightning.balance.decision.speeds import ProcessSpeeds
from dynmo_lightning.bench.faults import SlowProcess, parse_straggler
from dynmo_lightning.callbacks import GradualPruning, LayerFreezing, TokenEarlyExit
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import backend_device, fresh_world
from dynmo_lightning.models import GPT
from dynmo_lightning.profiling import DeviceClock


def real_preset(dynamic: str, n_layers: int, overrides: dict[str, Any] | None = None) -> L.Callback | None:
    """The dynamic of a real A/B case: the techniques of the timeline presets, acting within the first 60 steps.

    ``overrides`` replaces some of the preset's settings (e.g. a later early-exit ramp,
    :mod:`~dynmo_lightning.bench.straggler_real`); the presets themselves stay as the committed runs measured them.
    """
    if dynamic == "none":
        return None
    if dynamic == "freezing":  # AutoFreeze freezes a growing prefix window by window: 7 of 12 layers in two windows
        frozen = (7 * n_layers) // 12
        schedule = {i: 10 if i < frozen // 2 else 25 for i in range(frozen)}
        kind, kw = LayerFreezing, {"mode": "schedule", "schedule": schedule, "start_step": 0}
    elif dynamic == "pruning":  # cubic schedule to 80 % of neurons and heads ranked across layers, after a while
        kind, kw = GradualPruning, {"final_sparsity": 0.8, "start_step": 40, "end_step": 60, "every_n_steps": 4}
    elif dynamic == "early_exit":  # saturation exits after a quarter of the blocks, threshold ramped in 10 steps
        kind, kw = TokenEarlyExit, {"threshold": 0.9, "warmup_steps": 5, "ramp_steps": 10,
                                    "min_layers": max(1, (n_layers - 2) // 4)}  # fmt: skip
    else:
        raise ValueError(f"no real A/B preset for dynamic {dynamic!r}: use freezing, pruning, early_exit or none")
    return kind(**(kw | (overrides or {})))


class Window(L.Callback):
    """Wall time and tokens of the steps from ``start``, and the steps before which a dynamic changed layers."""

    def __init__(self, start: int) -> None:
        self.start, self.t0, self.steps, self.seconds = start, 0.0, 0, 0.0
        self.events: list[int] = []
        self.step_seconds: list[float] = []  # every step's wall time, from the first (hook to hook)
        self._begin = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Start the clock at ``start``; note a dynamics event reported before this step."""
        step = trainer.global_step
        self._begin = time.perf_counter()
        if step == self.start:
            self.t0 = self._begin
        if trainer.strategy.pipeline_control.changed_layers(step):
            self.events.append(step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Time so far (the last step's values stand)."""
        now = time.perf_counter()
        self.step_seconds.append(now - self._begin)
        if trainer.global_step > self.start:
            self.seconds = now - self.t0
            self.steps = trainer.global_step - self.start


class WindowCosts(L.Callback):
    """The per-layer costs the balancer profiled inside the window (for the ideal ratio of the same window)."""

    def __init__(self, balancer: DynMoBalancer, start: int) -> None:
        self.balancer, self.start = balancer, start
        self.samples: list[dict[int, dict[str, float]]] = []
        self.in_force: list[list[float]] = []  # the balancer's speeds in force after each sample
        self._seen: dict[int, dict[str, float]] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Keep the step's measurement if the balancer profiled it and it lies in the window."""
        measured = self.balancer.last_measured
        # a profile from before the window (all a one-shot policy ever takes) is no sample of it
        fresh, self._seen = measured is not None and measured is not self._seen, measured
        if trainer.global_step - 1 >= self.start and fresh:
            self.samples.append(measured)
            self.in_force.append(list(self.balancer.policy.speeds.in_force or []))

    def mean(self, normalised: bool = False) -> dict[str, Any] | None:
        """Per-layer forward and backward seconds averaged over the window's profiles.

        Args:
            normalised: each sample's times as at the reference speed first (:meth:`ProcessSpeeds.normalise`: times
                the kernel ratio of the process that ran the layer), so that a slow process's layers do not look
                expensive; ``False``: as measured.
        """
        if not self.samples:
            return None
        samples = [ProcessSpeeds.normalise(c) for c in self.samples] if normalised else self.samples
        n = len(samples[0])
        fwd = [statistics.fmean(c[i]["fwd"] for c in samples) for i in range(n)]
        bwd = [statistics.fmean(c[i]["bwd"] for c in samples) for i in range(n)]
        wgt = [statistics.fmean(c[i].get("bwd_weight", 0.0) for c in samples) for i in range(n)]
        return {"fwd": fwd, "bwd": bwd, "wgt": wgt, "samples": len(samples)}

    def speeds(self) -> list[list[float]]:
        """Every window sample's measured speed of each pipeline rank (fastest 1.0; ``[]``: no kernel times)."""
        out = []
        for c in self.samples:
            probes = ProcessSpeeds.probes(c)
            if probes:
                fastest = min(probes.values())
                out.append([fastest / probes[r] if r in probes else 1.0 for r in range(max(probes) + 1)])
        return out


def ideal_ratio(
    costs: dict[str, Any],
    n_ranks: int,
    n_microbatches: int,
    p2p: float,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    speeds: list[float] | None = None,
) -> float:
    """Step time of the uniform split over the best split's, both the makespan of the run's own schedule.

    The closed-form 1F1B model (``balance.step_time``: ``sum + (M - 1) max``) overstates a heavy *first* stage at
    few micro-batches (its extra work overlaps the later stages' fill and drain), and it knows nothing of a
    zero-bubble schedule's split backward or of a V placement. So both splits are timed by the event engine over
    the schedule's task order (:class:`~dynmo_lightning.balance.StepModel`, with the window's weight-gradient part
    of each layer's backward), and the best split is searched over every contiguous split when there are at most
    :data:`_EXHAUSTIVE` of them (P = 2: ``L - 1``), else it is :func:`~dynmo_lightning.balance.makespan_split`'s.
    With ``speeds`` (each rank's relative speed; ``costs`` then at the reference speed) a rank's tasks take their
    cost over its speed.
    """
    uniform, best = ideal_makespans(costs, n_ranks, n_microbatches, p2p, schedule, stages_per_rank, speeds)
    return uniform / best


def ideal_makespans(
    costs: dict[str, Any],
    n_ranks: int,
    n_microbatches: int,
    p2p: float,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    speeds: list[float] | None = None,
) -> tuple[float, float]:
    """The makespans of the uniform split and of the best split (arguments as :func:`ideal_ratio`'s)."""
    fwd, bwd = costs["fwd"], costs["bwd"]
    model = StepModel(fwd, bwd, n_microbatches, schedule, p2p, wgt=costs.get("wgt"), stages_per_rank=stages_per_rank,
                      speeds=speeds)  # fmt: skip
    n_layers, n_stages = len(fwd), n_ranks * stages_per_rank
    if math.comb(n_layers - 1, n_stages - 1) <= _EXHAUSTIVE:
        cuts = itertools.combinations(range(1, n_layers), n_stages - 1)
        best = min(model([b - a for a, b in itertools.pairwise((0, *c, n_layers))]) for c in cuts)
    else:
        best = makespan_split(model, n_stages)[0]  # type: ignore[index]
    return model(partition(model.costs, n_stages, method="uniform")), best


#: Most contiguous splits :func:`ideal_ratio` simulates one by one.
_EXHAUSTIVE = 2000


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Train one case in this process (one rank of the job); returns what this rank measured."""
    L.seed_everything(0)
    model_kw, data_kw = case["model"], case["data"]
    n_layers = model_kw["n_layer"] + 2  # the blocks, the embedding and the head
    window = Window(case["measure_from"])
    callbacks, balancer, costs = _case_callbacks(case, window, n_layers)
    trainer = _case_trainer(case, callbacks)
    data = StdlibCharDataModule(max_bytes=2_000_000, max_val_batches=8, **data_kw)
    trainer.fit(GPT(**model_kw), datamodule=data)
    result = {
        "tokens_per_s": window.steps * data.tokens_per_batch / window.seconds if window.seconds else None,
        "window_steps": window.steps,
        "step_seconds": [round(t, 5) for t in window.step_seconds],
        "partitions": trainer.strategy.pipeline_control.partitions,
        "events": window.events,
        "moves": [p["step"] for p in trainer.strategy.pipeline_control.partitions[1:]],
        "val_loss": float(trainer.callback_metrics.get("val_loss", math.nan)),
    }
    if balancer is not None and costs is not None:
        result.update(_balancer_result(balancer, costs))
    return result


def _case_callbacks(
    case: dict[str, Any], window: Window, n_layers: int
) -> tuple[list[L.Callback], DynMoBalancer | None, WindowCosts | None]:
    """A case's callbacks: the window, its dynamic, its straggler and, under a policy other than uniform, the balancer.

    Args:
        case: the case.
        window: the case's :class:`Window`.
        n_layers: pipeline layers of the case's model.

    Returns:
        The callbacks, the balancer and the window's costs it profiled (both ``None`` under the uniform policy).
    """
    callbacks: list[L.Callback] = [window]
    dynamic = real_preset(case["dynamic"], n_layers, case.get("preset"))
    if dynamic is not None:
        callbacks.append(dynamic)
    if case.get("straggler"):  # one process made slow (``RANK:FACTOR[:FROM_STEP[:PATTERN[:PERIOD]]]``)
        callbacks.append(SlowProcess(**parse_straggler(case["straggler"])))
    balancer = costs = None
    if case["policy"] != "uniform":
        balancer = DynMoBalancer(method=case["policy"], **case["balancer"])
        costs = WindowCosts(balancer, case["measure_from"])
        callbacks += [balancer, costs]
    return callbacks, balancer, costs


def _case_trainer(case: dict[str, Any], callbacks: list[L.Callback]) -> L.Trainer:
    """The case's trainer: ``steps`` steps under DynMo's strategy, one validation at the end, nothing else."""
    steps = case["steps"]
    return L.Trainer(
        accelerator=case["accelerator"],
        devices=case["world_size"],
        max_steps=steps,
        strategy=DynMoStrategy(
            n_microbatches=case["microbatches"],
            schedule=case.get("schedule", "1f1b"),
            stages_per_rank=case.get("stages_per_rank", 1),
        ),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=steps,
        limit_val_batches=8,
        num_sanity_val_steps=0,
    )


def _balancer_result(balancer: DynMoBalancer, costs: WindowCosts) -> dict[str, Any]:
    """What a balanced case adds to its result: the profile interval, the window's costs, the checks, the moves."""
    result: dict[str, Any] = {
        "profile_every_n_steps": balancer.policy.profile_every_n_steps,
        "window_costs": costs.mean(),
        # a straggler's layers look expensive as measured: the costs at the reference speed, and the speeds
        "window_costs_normalised": costs.mean(normalised=True),
        "window_speeds": costs.speeds(),
        "speeds_in_force": costs.in_force,
        "checks": [
            {k: h.get(k) for k in ("step", "current", "proposed", "migrated", "current_step_s", "predicted_step_s",
                                   "predicted_saving_s", "predicted_migration_s")}
            for h in balancer.history
        ],
    }  # fmt: skip
    moves = [h for h in balancer.history if h.get("migrated") and h["migrate_s"] > 0]
    if moves:  # this process's bytes over its migration time
        result["migration_bytes_per_s"] = sum(h["bytes_moved"] for h in moves) / sum(h["migrate_s"] for h in moves)
    return result


def measure_p2p(size_bytes: int, repeats: int = 20) -> dict[str, float]:
    """Latency and bandwidth of one point-to-point transfer between ranks 0 and 1 (collective over the job).

    The tensors live where the job's backend sends from (:func:`~dynmo_lightning.launch.backend_device`: the rank's
    GPU under NCCL, the CPU under gloo), and the clock is the device's: NCCL's transfers are asynchronous to the
    host, so on a GPU CUDA events recorded around them are read after a synchronisation, never the host clock alone.
    One untimed round trip of each size comes first: NCCL creates the pair's communicator on its first send, which
    would otherwise count as latency.
    """
    rank, device = dist.get_rank(), backend_device()
    clock = DeviceClock(device)
    results = {}
    for name, n in (("latency", 1), ("bandwidth", size_bytes // 4)):
        t = torch.zeros(n, device=device)
        _round_trips(t, rank, 1)
        dist.barrier()
        start = clock.now()
        _round_trips(t, rank, repeats)
        end = clock.now()
        one_way = clock.elapsed(start, end) / (2 * repeats)  # on a GPU: waits for the end event first
        results[name] = one_way if name == "latency" else n * 4 / one_way
    return {"p2p_latency_s": results["latency"], "p2p_bytes_per_s": results["bandwidth"], "p2p_bytes": size_bytes}


def _round_trips(t: torch.Tensor, rank: int, repeats: int) -> None:
    """Send ``t`` from rank 0 to rank 1 and back, ``repeats`` times (other ranks take no part)."""
    for _ in range(repeats):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)


def worker(spec_path: str) -> None:
    """Run the cases of ``spec_path`` in this rank; rank 0 writes each case's result file.

    Every case trains in a world of its own (:func:`~dynmo_lightning.launch.fresh_world`: the next case meets at a
    store the last one's rank 0 opened). After the first case, the ranks measure their link (``spec["link"]``: the
    activation bytes of one transfer).
    """
    spec = json.loads(Path(spec_path).read_text())
    for index, case in enumerate(spec["cases"]):
        with fresh_world():
            result = run_case(case)
            if dist.get_rank() == 0:
                Path(case["result"]).write_text(json.dumps(result))
            if index == 0 and spec.get("link"):
                link = measure_p2p(spec["link"]["bytes"])
                if dist.get_rank() == 0:
                    Path(spec["link"]["result"]).write_text(json.dumps(link))


def interval95(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % confidence interval (Student's t) of ``values``."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = _T95[min(n - 1, len(_T95)) - 1] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


#: Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96 is close).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def summarize(
    cases: list[dict[str, Any]], results: dict[str, dict[str, Any]], link: dict[str, float]
) -> list[dict[str, Any]]:
    """Per dynamic and policy: tokens/s, and the ratio to uniform paired repeat by repeat, with 95 % intervals.

    A repeat's ratio divides the policy's tokens/s by the uniform run next to it (they ran one after the other). The
    ideal ratio of a repeat comes from the per-layer costs its balancer measured in the window and the measured
    point-to-point time of one activation (``link``, from :func:`measure_p2p`).
    """
    p2p = link["p2p_latency_s"] + link["p2p_bytes"] / link["p2p_bytes_per_s"]
    by_key: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for case in cases:
        by_key.setdefault((case["dynamic"], case["policy"]), {})[case["repeat"]] = results[case["name"]]
    return [_summary_row(dynamic, policy, by_key, cases, p2p) for dynamic, policy in sorted(by_key)]


def _summary_row(
    dynamic: str,
    policy: str,
    by_key: dict[tuple[str, str], dict[int, dict[str, Any]]],
    cases: list[dict[str, Any]],
    p2p: float,
) -> dict[str, Any]:
    """One row of :func:`summarize`: a dynamic under a policy over its repeats.

    Args:
        dynamic: the dynamic.
        policy: the policy.
        by_key: every case's result, by dynamic and policy, then by repeat.
        cases: the cases (the row's run shape: ranks, micro-batches, schedule).
        p2p: seconds of one activation's point-to-point transfer.
    """
    runs = by_key[(dynamic, policy)]
    ratios = _paired(runs, by_key[(dynamic, "uniform")])
    mean, low, high = interval95(ratios)
    # over the split balanced once (profile once, never move): what re-balancing during training adds
    over = _paired(runs, by_key.get((dynamic, "static_time"), {}))
    over_static = dict(zip(("ratio", "ratio_low", "ratio_high"), interval95(over), strict=True)) if over else None
    ideal = _mean_ideal(runs, next(c for c in cases if c["dynamic"] == dynamic and c["policy"] == policy), p2p)
    lag = _lag(list(runs.values()))
    return {
        "dynamic": dynamic,
        "policy": policy,
        "tokens_per_s": [runs[r]["tokens_per_s"] for r in sorted(runs)],
        "ratio": mean,
        "ratio_low": low,
        "ratio_high": high,
        "ratios": ratios,
        "over_static_time": over_static,
        "ideal_ratio": ideal,
        "share_of_ideal": mean / ideal if ideal else None,
        "val_loss": statistics.fmean(run["val_loss"] for run in runs.values()),
        "reaction_lag_steps": lag,
        "partitions": next(iter(runs.values()))["partitions"],
    }


def _paired(runs: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[float]:
    """Tokens/s of ``runs`` over ``base``'s, repeat by repeat (the repeats both ran)."""
    return [runs[r]["tokens_per_s"] / base[r]["tokens_per_s"] for r in sorted(runs) if r in base]


def _mean_ideal(runs: dict[int, dict[str, Any]], shape: dict[str, Any], p2p: float) -> float | None:
    """The ideal ratio averaged over the repeats that profiled their window (``None``: none did)."""
    placement = (shape.get("schedule", "1f1b"), shape.get("stages_per_rank", 1))
    ideals = [
        ideal_ratio(run["window_costs"], shape["world_size"], shape["microbatches"], p2p, *placement)
        for run in runs.values()
        if run.get("window_costs")
    ]
    return statistics.fmean(ideals) if ideals else None


def across_arms(
    cases: list[dict[str, Any]], results: dict[str, dict[str, Any]], first: str, second: str
) -> list[dict[str, Any]]:
    """Per dynamic and policy both arms ran: the second arm's tokens/s over the first's, paired by repeat (95 %).

    Both arms ran in the same processes, one case after the other within every repeat (``dynmo-bench``'s
    ``real.also``): e.g. DynMo under ZBV over DynMo under 1F1B, measured, not simulated.
    """
    speed: dict[tuple[str, str, str], dict[int, float]] = {}
    for case in cases:
        key = (case["stem"], case["dynamic"], case["policy"])
        speed.setdefault(key, {})[case["repeat"]] = results[case["result"]]["tokens_per_s"]
    rows = []
    for stem, dynamic, policy in sorted(speed):
        theirs = speed.get((first, dynamic, policy))
        if stem != second or theirs is None:
            continue
        mine = speed[(stem, dynamic, policy)]
        ratios = [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]
        mean, low, high = interval95(ratios)
        rows.append({"dynamic": dynamic, "policy": policy, "ratio": mean, "ratio_low": low, "ratio_high": high,
                     "ratios": ratios})  # fmt: skip
    return rows


def _lag(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Steps from each dynamics event (or burst of events) to the move that answered it, over all repeats.

    A move answers an event when it is the first move after the event and comes before the next event. An event with
    no move before the next one (every check in between kept the split: by the balancer's cost model the re-plan did
    not pay) has no lag; ``answered`` of ``events`` says how many were answered.
    """
    lags, interval, total = [], None, 0
    for run in runs:
        interval = run.get("profile_every_n_steps", interval)
        events, moves = run["events"], run["moves"]
        bursts = [e for k, e in enumerate(events) if k + 1 == len(events) or events[k + 1] - e > 1]
        total += len(bursts)
        for k, event in enumerate(bursts):
            until = bursts[k + 1] if k + 1 < len(bursts) else math.inf
            answer = [m for m in moves if event <= m < until]
            if answer:
                lags.append(answer[0] - event)
    if not lags or interval is None:
        return None
    return {
        "max_steps": max(lags), "profile_interval": interval, "max_intervals": max(lags) / interval,
        "answered": len(lags), "events": total,
    }  # fmt: skip
