"""Discrete-event execution of one pipeline step: every forward and backward task, on every stage, in order.

Each stage is one worker that runs its tasks one at a time in the fixed order its schedule gives (it waits when the
next task is not ready; it never reorders). A task starts at the latest of: its stage finishing the previous task,
and its dependency finishing plus ``p2p``. Transfers are pure latency: they overlap with compute and links never
contend. With fixed orders and no other shared resource this earliest-start rule *is* the event-driven execution.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dynmo_lightning.balance import stage_times
from dynmo_lightning.balance._validation import as_values
from dynmo_lightning.balance.cost_model import SCHEDULES


class Task(NamedTuple):
    """One forward (``"F"``) or backward (``"B"``) of one micro-batch on one stage, with its start and end."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated step.

    Attributes:
        step_time: makespan: when the last task on any stage ends.
        busy: time each stage spent computing.
        bubble_fraction: ``1 - sum(busy) / (P * step_time)`` (0 for a step that takes no time).
        timeline: every task, sorted by start time (then stage).
    """

    step_time: float
    busy: list[float]
    bubble_fraction: float
    timeline: list[Task]

    @property
    def n_stages(self) -> int:
        """Pipeline stages simulated."""
        return len(self.busy)

    def to_chrome_trace(self, time_scale: float = 1e6) -> dict[str, Any]:
        """Render the timeline for ``chrome://tracing`` / Perfetto (one row per stage).

        Args:
            time_scale: trace microseconds per simulated time unit (1e6 when times are seconds).

        Returns:
            A JSON-serialisable ``{"traceEvents": [...]}`` dictionary of complete (``"X"``) events.
        """
        events = [
            {
                "name": f"{t.kind}{t.microbatch}",
                "cat": "forward" if t.kind == "F" else "backward",
                "ph": "X",
                "pid": 0,
                "tid": t.stage,
                "ts": t.start * time_scale,
                "dur": (t.end - t.start) * time_scale,
            }
            for t in self.timeline
        ]
        return {"traceEvents": events}


def schedule_order(n_stages: int, n_microbatches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """The order in which each stage runs its tasks.

    Args:
        n_stages: pipeline stages ``P``.
        n_microbatches: micro-batches ``M``.
        schedule: ``"gpipe"`` (all forwards, then all backwards, micro-batches in order) or ``"1f1b"`` (as
            ``torch.distributed.pipelining.Schedule1F1B``: stage ``s`` runs ``min(M, P - s)`` warm-up forwards,
            then alternates one backward and one forward, then the remaining backwards).

    Returns:
        Per stage, a list of ``(kind, microbatch)`` with kind ``"F"`` or ``"B"``.

    Raises:
        ValueError: for an unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
    forwards = [("F", m) for m in range(n_microbatches)]
    backwards = [("B", m) for m in range(n_microbatches)]
    if schedule == "gpipe":
        return [forwards + backwards for _ in range(n_stages)]
    orders = []
    for s in range(n_stages):
        warmup = min(n_microbatches, n_stages - s)
        steady = [task for i in range(n_microbatches - warmup) for task in (backwards[i], forwards[warmup + i])]
        orders.append(forwards[:warmup] + steady + backwards[n_microbatches - warmup :])
    return orders


def simulate(
    stage_fwd: Sequence[float] | Sequence[Sequence[float]],
    stage_bwd: Sequence[float] | Sequence[Sequence[float]],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
) -> SimResult:
    """Execute one training step (all micro-batches, forward and backward) over one worker per stage.

    Dependencies: forward ``m`` on stage ``s`` needs forward ``m`` on stage ``s - 1`` plus ``p2p``; backward ``m``
    on stage ``s`` needs backward ``m`` on stage ``s + 1`` plus ``p2p`` (on the last stage: its own forward ``m``).

    Args:
        stage_fwd: forward time of each stage for one micro-batch: ``[P]``, or ``[P][M]`` when micro-batches
            differ (e.g. token routing).
        stage_bwd: backward times, shaped like ``stage_fwd``.
        n_microbatches: micro-batches per step, ``M >= 1``.
        schedule: ``"gpipe"`` or ``"1f1b"`` (see :func:`schedule_order`).
        p2p: time to send one activation or gradient one hop.

    Returns:
        The step's :class:`SimResult`.

    Raises:
        ValueError: for negative or non-finite times, mismatched shapes, ``M < 1``, a negative ``p2p`` or an
            unknown schedule.
    """
    m_count = _microbatches(n_microbatches)
    if not (np.isfinite(p2p) and p2p >= 0):
        raise ValueError(f"p2p must be a finite time >= 0, got {p2p!r}")
    fwd = _per_microbatch(stage_fwd, "stage_fwd", m_count)
    bwd = _per_microbatch(stage_bwd, "stage_bwd", m_count)
    if len(fwd) != len(bwd):
        raise ValueError(f"{len(fwd)} stage forward times but {len(bwd)} backward times: give one of each per stage")
    n_stages = len(fwd)
    orders = schedule_order(n_stages, m_count, schedule)
    p2p = float(p2p)
    ends: dict[str, list[list[float | None]]] = {k: [[None] * m_count for _ in range(n_stages)] for k in "FB"}
    durations = {"F": fwd.tolist(), "B": bwd.tolist()}
    position, free = [0] * n_stages, [0.0] * n_stages
    timeline: list[Task] = []
    while len(timeline) < 2 * n_stages * m_count:
        progressed = False
        for s, order in enumerate(orders):
            while position[s] < len(order):
                kind, m = order[position[s]]
                ready = _ready(ends, kind, s, m, n_stages, p2p)
                if ready is None:
                    break
                start = max(free[s], ready)
                free[s] = start + durations[kind][s][m]
                ends[kind][s][m] = free[s]
                timeline.append(Task(s, kind, m, start, free[s]))
                position[s] += 1
                progressed = True
        if not progressed:  # cannot happen for GPipe or 1F1B orders; guards against a broken order
            raise RuntimeError(f"schedule deadlocked at positions {position}")
    timeline.sort(key=lambda t: (t.start, t.stage, t.end))
    makespan = max(free)
    busy = [math.fsum(fwd[s]) + math.fsum(bwd[s]) for s in range(n_stages)]
    bubble = 1.0 - sum(busy) / (n_stages * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble, timeline)


def simulate_layers(
    layer_fwd: Sequence[float] | Sequence[Sequence[float]],
    layer_bwd: Sequence[float] | Sequence[Sequence[float]],
    layers_per_stage: Sequence[int],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
) -> SimResult:
    """Simulate a step from per-layer costs and a partition (stage sums by :func:`balance.stage_times`).

    Args:
        layer_fwd: forward time of each layer for one micro-batch: ``[L]``, or ``[L][M]`` per micro-batch.
        layer_bwd: backward times, shaped like ``layer_fwd``.
        layers_per_stage: a valid partition of the layers.
        n_microbatches: micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        p2p: one-hop transfer time.

    Returns:
        The step's :class:`SimResult`.

    Raises:
        ValueError: as :func:`simulate`, or if the partition does not fit the layers.
    """
    fwd, bwd = np.asarray(layer_fwd, dtype=np.float64), np.asarray(layer_bwd, dtype=np.float64)
    if fwd.ndim == 2 and bwd.ndim == 2 and fwd.shape == bwd.shape:
        columns = [stage_times(fwd[:, m], bwd[:, m], layers_per_stage) for m in range(fwd.shape[1])]
        stage_fwd = np.array([c[0] for c in columns]).T
        stage_bwd = np.array([c[1] for c in columns]).T
        return simulate(stage_fwd, stage_bwd, n_microbatches, schedule, p2p)
    return simulate(*stage_times(layer_fwd, layer_bwd, layers_per_stage), n_microbatches, schedule, p2p)


def _ready(
    ends: dict[str, list[list[float | None]]], kind: str, s: int, m: int, n_stages: int, p2p: float
) -> float | None:
    """When a task's dependency (plus the hop) is satisfied, or ``None`` while it has not run yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        upstream = ends["F"][s - 1][m]
        return None if upstream is None else upstream + p2p
    if s == n_stages - 1:
        return ends["F"][s][m]
    downstream = ends["B"][s + 1][m]
    return None if downstream is None else downstream + p2p


def _microbatches(n_microbatches: int) -> int:
    if isinstance(n_microbatches, bool) or operator.index(n_microbatches) < 1:
        raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
    return operator.index(n_microbatches)


def _per_microbatch(values: Sequence[float] | Sequence[Sequence[float]], name: str, n_microbatches: int) -> np.ndarray:
    """Per-stage times as a ``[P][M]`` array: 1-D input repeats for every micro-batch."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 2:
        if array.shape[1] != n_microbatches:
            raise ValueError(f"{name} has {array.shape[1]} columns but n_microbatches={n_microbatches}")
        rows = [as_values(row, f"{name}[{s}]") for s, row in enumerate(array)]
        if not rows:
            raise ValueError(f"no {name} given: give at least one stage")
        return np.stack(rows)
    flat = as_values(array, name)
    if flat.size == 0:
        raise ValueError(f"no {name} given: give at least one stage")
    return np.repeat(flat[:, None], n_microbatches, axis=1)
