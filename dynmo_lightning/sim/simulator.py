"""Discrete-event execution of one pipeline step: every forward and backward task, on every rank, in order.

The event engine and the task orders are :mod:`dynmo_lightning.balance.steptime.makespan`'s (the one implementation the
policy's decisions and this simulator share): each rank runs its stages' tasks one at a time in the fixed order its
schedule gives (it waits when the next task is not ready; it never reorders). A task starts at the latest of: its
rank finishing the previous task, and its dependency finishing plus ``p2p`` (0 between stages on one rank).
Transfers are pure latency: they overlap with compute and links never contend. This module adds the timeline
(:class:`SimResult`) and per-layer input (:func:`simulate_layers`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dynmo_lightning.balance import stage_times
from dynmo_lightning.balance.steptime.makespan import SINGLE, microbatches, per_microbatch, rank_orders, timeline


class Task(NamedTuple):
    """One task of one micro-batch on one stage, with its start and end.

    ``kind``: ``"F"`` forward, ``"B"`` full backward, or a zero-bubble schedule's ``"I"`` (backward-input) and
    ``"W"`` (backward-weight) parts.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated step.

    Attributes:
        step_time: makespan: when the last task on any rank ends.
        busy: time each stage spent computing.
        bubble_fraction: ``1 - sum(busy) / (R * step_time)`` over the ``R`` ranks (0 for a step that takes no time).
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
    """The order in which each stage runs its tasks, for the one-stage-per-rank schedules.

    Args:
        n_stages: pipeline stages ``P``.
        n_microbatches: micro-batches ``M``.
        schedule: ``"gpipe"`` (all forwards, then all backwards, micro-batches in order) or ``"1f1b"`` (as
            ``torch.distributed.pipelining.Schedule1F1B``: stage ``s`` runs ``min(M, P - s)`` warm-up forwards,
            then alternates one backward and one forward, then the remaining backwards). Every schedule's per-rank
            order is :func:`dynmo_lightning.balance.steptime.makespan.rank_orders`.

    Returns:
        Per stage, a list of ``(kind, microbatch)`` with kind ``"F"`` or ``"B"``.

    Raises:
        ValueError: for a schedule outside ``"gpipe"`` and ``"1f1b"``.
    """
    if schedule not in SINGLE:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SINGLE)}")
    return [[(kind, m) for kind, _, m in order] for order in rank_orders(schedule, n_stages, n_microbatches)]


def simulate(
    stage_fwd: Sequence[float] | Sequence[Sequence[float]],
    stage_bwd: Sequence[float] | Sequence[Sequence[float]],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    *,
    stage_wgt: Sequence[float] | Sequence[Sequence[float]] | None = None,
    stages_per_rank: int = 1,
) -> SimResult:
    """Execute one training step (all micro-batches, forward and backward) over the schedule's ranks.

    Dependencies: forward ``m`` on stage ``s`` needs forward ``m`` on stage ``s - 1`` plus ``p2p``; backward ``m``
    on stage ``s`` needs backward ``m`` on stage ``s + 1`` plus ``p2p`` (on the last stage: its own forward ``m``);
    the hop is free between stages on one rank.

    Args:
        stage_fwd: forward time of each stage for one micro-batch: ``[P]``, or ``[P][M]`` when micro-batches
            differ (e.g. token routing).
        stage_bwd: full backward times, shaped like ``stage_fwd``.
        n_microbatches: micro-batches per step, ``M >= 1``.
        schedule: one of :data:`dynmo_lightning.balance.steptime.makespan.SCHEDULES` (``"gpipe"``, ``"1f1b"``, see
            :func:`schedule_order`; ``"interleaved_1f1b"``, ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"``).
        p2p: time to send one activation or gradient one hop.
        stage_wgt: the weight-gradient part of ``stage_bwd`` (zero-bubble ``W`` tasks); ``None``: 0.
        stages_per_rank: stages per rank (2 for the V schedules).

    Returns:
        The step's :class:`SimResult`.

    Raises:
        ValueError: for negative or non-finite times, mismatched shapes, ``M < 1``, a negative ``p2p`` or an
            unknown schedule.
    """
    m_count = microbatches(n_microbatches)
    fwd = per_microbatch(stage_fwd, "stage_fwd", m_count)
    bwd = per_microbatch(stage_bwd, "stage_bwd", m_count)
    if len(fwd) != len(bwd):
        raise ValueError(f"{len(fwd)} stage forward times but {len(bwd)} backward times: give one of each per stage")
    makespan, timings = timeline(
        fwd, bwd, m_count, schedule, p2p, stage_wgt=stage_wgt, stages_per_rank=stages_per_rank, record=True
    )
    tasks = sorted((Task(t.stage, t.kind, t.microbatch, t.start, t.end) for t in timings), key=_by_start)
    busy = [math.fsum(fwd[s]) + math.fsum(bwd[s]) for s in range(len(fwd))]
    n_ranks = len(fwd) // stages_per_rank
    bubble = 1.0 - sum(busy) / (n_ranks * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble, tasks)


def _by_start(task: Task) -> tuple[float, int, float]:
    return (task.start, task.stage, task.end)


def simulate_layers(
    layer_fwd: Sequence[float] | Sequence[Sequence[float]],
    layer_bwd: Sequence[float] | Sequence[Sequence[float]],
    layers_per_stage: Sequence[int],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    *,
    layer_wgt: Sequence[float] | None = None,
    stages_per_rank: int = 1,
) -> SimResult:
    """Simulate a step from per-layer costs and a partition (stage sums by :func:`balance.stage_times`).

    Args:
        layer_fwd: forward time of each layer for one micro-batch: ``[L]``, or ``[L][M]`` per micro-batch.
        layer_bwd: full backward times, shaped like ``layer_fwd``.
        layers_per_stage: a valid partition of the layers.
        n_microbatches: micro-batches per step.
        schedule: a schedule of :func:`simulate`.
        p2p: one-hop transfer time.
        layer_wgt: the weight-gradient part of each layer's backward (``[L]``; zero-bubble schedules).
        stages_per_rank: stages per rank.

    Returns:
        The step's :class:`SimResult`.

    Raises:
        ValueError: as :func:`simulate`, or if the partition does not fit the layers.
    """
    placement = {"stages_per_rank": stages_per_rank}
    if layer_wgt is not None:
        placement["stage_wgt"] = stage_times(layer_wgt, layer_wgt, layers_per_stage)[0]  # type: ignore[assignment]
    fwd, bwd = np.asarray(layer_fwd, dtype=np.float64), np.asarray(layer_bwd, dtype=np.float64)
    if fwd.ndim == 2 and bwd.ndim == 2 and fwd.shape == bwd.shape:
        columns = [stage_times(fwd[:, m], bwd[:, m], layers_per_stage) for m in range(fwd.shape[1])]
        stage_fwd = np.array([c[0] for c in columns]).T
        stage_bwd = np.array([c[1] for c in columns]).T
        return simulate(stage_fwd, stage_bwd, n_microbatches, schedule, p2p, **placement)  # type: ignore[arg-type]
    stage_fwd, stage_bwd = stage_times(layer_fwd, layer_bwd, layers_per_stage)  # type: ignore[arg-type]
    return simulate(stage_fwd, stage_bwd, n_microbatches, schedule, p2p, **placement)  # type: ignore[arg-type]
