"""Analytic pipeline cost model: what one optimizer step costs under a split, and whether re-splitting pays.

Model (the standard fill/drain picture, also used by the discrete-event simulator):

* every stage ``s`` spends ``f_s`` on the forward and ``b_s`` on the backward of one micro-batch, the same for all
  ``M`` micro-batches; a stage runs one micro-batch at a time;
* sending an activation (or a gradient) one hop costs ``p2p``; transfers overlap with compute in the steady state,
  so only the ``P - 1`` forward hops of the fill and the ``P - 1`` backward hops of the drain add to the step time;
* GPipe runs all forwards, then all backwards. Each pass is a flow shop of ``M`` identical jobs over ``P``
  machines, whose makespan is ``sum_s t_s + (M - 1) * max_s t_s``: the first micro-batch crosses every stage, the
  other ``M - 1`` follow at the pace of the slowest one. Step time:
  ``sum f + (M - 1) max f + sum b + (M - 1) max b + 2 (P - 1) p2p``;
* 1F1B alternates one forward and one backward per stage in the steady state, so the slowest ``f_s + b_s`` sets
  the pace: ``sum (f + b) + (M - 1) max (f + b) + 2 (P - 1) p2p``.

With equal stages (``f_s = f``, ``b_s = b``) both reduce to ``(M + P - 1)(f + b) + 2 (P - 1) p2p``. The model
ignores optimizer, gradient all-reduce and recomputation time, and memory limits on in-flight micro-batches.

Where the closed form is exact (``tests/balance/test_makespan.py``, ``tests/sim/test_sim_closed_form.py``): GPipe
with per-stage constant times, any stages and any ``p2p``; 1F1B with equal stages and ``p2p = 0``. Elsewhere it
is off both ways (a heavy first stage at few micro-batches hides in the others' fill; forward and backward
bottlenecks on different stages stall the warm-up; 1F1B cannot hide the hops), and it knows nothing of interleaved
or zero-bubble schedules. Decisions therefore never use it: the policy, the repack planner, the oracle and the
simulator use the makespan of the schedule's own task order (:mod:`~dynmo_lightning.balance.steptime.makespan`,
:class:`~dynmo_lightning.balance.steptime.planner.StepModel`). :func:`step_time` and :func:`should_repartition` stay for
the quick estimate and for comparison; :func:`repartition_pays` is the rule the policy applies to makespans.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from dynmo_lightning.balance.split.checks import as_values
from dynmo_lightning.balance.split.loads import stage_loads

SCHEDULES = ("gpipe", "1f1b")


def _pair(fwd: Sequence[float], bwd: Sequence[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    forward, backward = as_values(fwd, f"{what} forward times"), as_values(bwd, f"{what} backward times")
    if forward.size != backward.size:
        raise ValueError(
            f"{forward.size} {what} forward times but {backward.size} backward times: give one of each per {what}"
        )
    if forward.size == 0:
        raise ValueError(f"no {what} times given: give at least one {what}")
    return forward, backward


def stage_times(
    fwd: Sequence[float], bwd: Sequence[float], layers_per_stage: Sequence[int]
) -> tuple[list[float], list[float]]:
    """Per-stage forward and backward time of one micro-batch.

    Args:
        fwd: forward time of each layer for one micro-batch.
        bwd: backward time of each layer for one micro-batch.
        layers_per_stage: a valid partition of the layers.

    Returns:
        ``(stage_fwd, stage_bwd)``: the sums over each stage's layers.

    Raises:
        ValueError: if the times are invalid, differ in length, or the partition does not fit them.

    """
    forward, backward = _pair(fwd, bwd, "layer")
    return stage_loads(forward, layers_per_stage), stage_loads(backward, layers_per_stage)


def _step(forward: np.ndarray, backward: np.ndarray, n_microbatches: int, schedule: str, p2p: float) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
    if isinstance(n_microbatches, bool) or operator.index(n_microbatches) < 1:
        raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
    if not (math.isfinite(p2p) and p2p >= 0):
        raise ValueError(f"p2p must be a finite time >= 0, got {p2p!r}")
    repeats = n_microbatches - 1
    hops = 2 * (forward.size - 1) * p2p
    if schedule == "gpipe":
        passes = (math.fsum(t) + repeats * float(t.max()) for t in (forward, backward))
        return math.fsum(passes) + hops
    both = forward + backward
    return math.fsum(both) + repeats * float(both.max()) + hops


def step_time(
    stage_fwd: Sequence[float],
    stage_bwd: Sequence[float],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
) -> float:
    """Predicted time of one optimizer step (all micro-batches) under the module's fill/drain model.

    Args:
        stage_fwd: forward time of each stage for one micro-batch.
        stage_bwd: backward time of each stage for one micro-batch.
        n_microbatches: micro-batches per step, ``M >= 1``.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        p2p: time to send one activation or gradient one hop.

    Returns:
        GPipe: ``sum f + (M-1) max f + sum b + (M-1) max b + 2(P-1) p2p``; 1F1B:
        ``sum (f+b) + (M-1) max (f+b) + 2(P-1) p2p``.

    Raises:
        ValueError: for invalid times, an unknown schedule, ``M < 1`` or a negative ``p2p``.

    """
    forward, backward = _pair(stage_fwd, stage_bwd, "stage")
    return _step(forward, backward, n_microbatches, schedule, p2p)


def bubble_fraction(
    stage_fwd: Sequence[float],
    stage_bwd: Sequence[float],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
) -> float:
    """Share of the stages' time spent idle during one step.

    Args:
        stage_fwd: forward time of each stage for one micro-batch.
        stage_bwd: backward time of each stage for one micro-batch.
        n_microbatches: micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        p2p: time to send one activation or gradient one hop.

    Returns:
        ``1 - M * sum_s (f_s + b_s) / (P * step_time)``; 0 when the step takes no time at all.

    Raises:
        ValueError: as :func:`step_time`.

    """
    forward, backward = _pair(stage_fwd, stage_bwd, "stage")
    total = _step(forward, backward, n_microbatches, schedule, p2p)
    if total == 0:
        return 0.0
    busy = n_microbatches * (math.fsum(forward) + math.fsum(backward))
    return 1.0 - busy / (forward.size * total)


def should_repartition(
    fwd: Sequence[float],
    bwd: Sequence[float],
    current: Sequence[int],
    proposed: Sequence[int],
    *,
    n_microbatches: int,
    schedule: str,
    p2p: float = 0.0,
    steps_until_next_check: int,
    migration_cost: float,
    min_gain: float,
) -> tuple[bool, float]:
    """Decide whether moving from the current split to a proposed one pays off before the next check.

    Rule: with ``t_cur`` and ``t_new`` the predicted step times (:func:`step_time`) of the two splits, the predicted
    saving is ``(t_cur - t_new) * steps_until_next_check``. Migrate iff the saving exceeds ``migration_cost``
    *and* the relative gain ``(t_cur - t_new) / t_cur`` exceeds ``min_gain`` (both strictly). The second test keeps
    measurement noise from triggering migrations when the horizon is long.

    Args:
        fwd: forward time of each layer for one micro-batch.
        bwd: backward time of each layer for one micro-batch.
        current: layers per stage now.
        proposed: layers per stage after migrating.
        n_microbatches: micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        p2p: time to send one activation or gradient one hop.
        steps_until_next_check: optimizer steps the new split would run before the next decision.
        migration_cost: seconds a migration costs (moving layers with their state, rebuilding stages).
        min_gain: smallest relative step-time gain worth migrating for (0.05 = 5 %).

    Returns:
        ``(decision, predicted saving in seconds over the horizon, before subtracting migration_cost)``; the saving
        is negative when the proposal is slower.

    Raises:
        ValueError: for invalid times or partitions, a negative horizon, cost or gain, and as :func:`step_time`.

    """
    if isinstance(steps_until_next_check, bool) or operator.index(steps_until_next_check) < 0:
        raise ValueError(f"steps_until_next_check must be an integer >= 0, got {steps_until_next_check!r}")
    for name, value in (("migration_cost", migration_cost), ("min_gain", min_gain)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    t_cur, t_new = (
        step_time(*stage_times(fwd, bwd, split), n_microbatches, schedule, p2p) for split in (current, proposed)
    )
    return repartition_pays(t_cur, t_new, steps_until_next_check, migration_cost, min_gain)


def repartition_pays(
    t_cur: float, t_new: float, steps_until_next_check: int, migration_cost: float, min_gain: float
) -> tuple[bool, float]:
    """The rule of :func:`should_repartition` on the two predicted step times (no per-layer costs needed).

    Returns:
        ``(decision, predicted saving over the horizon)``.
    """
    saving = (t_cur - t_new) * steps_until_next_check
    gain = (t_cur - t_new) / t_cur if t_cur > 0 else 0.0
    return saving > migration_cost and gain > min_gain, saving
