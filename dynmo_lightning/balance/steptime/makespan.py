"""The step time of a pipeline schedule's own task order: an event engine over every forward and backward task.

Every decision (migrate, repack, grow) and every oracle rests on this model, not on the closed form of
:func:`~dynmo_lightning.balance.steptime.closed_form.step_time` (exact only where its docstring says).

Task orders are torch 2.13's (``torch.distributed.pipelining.schedules``), reproduced here in pure Python because
this package must not import torch; ``tests/balance/test_makespan.py`` checks them against torch's classes:

* ``"gpipe"`` and ``"1f1b"`` - ``ScheduleGPipe`` / ``Schedule1F1B`` (one stage per rank: all forwards then all
  backwards; ``min(M, P - s)`` warm-up forwards, then one backward and one forward in turn, then the backwards);
* ``"interleaved_1f1b"`` and ``"interleaved_zb"`` - ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``
  (``_get_1f1b_rank_ops``; the zero-bubble one splits each backward into input (``I``) and weight (``W``) parts
  and delays the ``W`` into the bubbles);
* ``"zbv"`` and ``"dualpipev"`` - ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``, two stages per rank in a V
  (:func:`~dynmo_lightning.balance.split.placement.stage_ranks`). DualPipeV's overlapped forward+backward pairs run
  their two halves one after the other, as the runtime does without a custom overlap function.

Execution model: a rank runs its tasks one at a time in the fixed order of its schedule, waiting when the next
task's input is not there yet (it never reorders). A forward of micro-batch ``m`` on stage ``s`` needs stage
``s - 1``'s forward of ``m``; a backward (full ``B`` or input part ``I``) needs stage ``s + 1``'s backward of
``m`` (on the last stage: its own forward); a weight part ``W`` needs its own ``I``. Crossing to another rank adds
``p2p`` (pure latency: transfers overlap with compute and links never contend; stages on one rank hand over for
free). With fixed orders and no other shared resource the earliest-start rule is the event-driven execution, so
each rank is advanced until it blocks and woken when the task it waits for ends: ``O(P M)`` work in all.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from dynmo_lightning.balance.split.checks import as_values
from dynmo_lightning.balance.split.placement import V_SCHEDULES, stage_ranks

#: Schedules the engine knows, with torch 2.13's task order each.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
#: Schedules that split the backward into an input part (``I``) and a weight part (``W``).
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")
#: Schedules with exactly one stage per rank.
SINGLE = ("gpipe", "1f1b")

#: One task of a rank's order: ``(kind, stage, microbatch)``, kind ``"F"``, ``"B"`` (full backward), ``"I"`` or
#: ``"W"``.
Action = tuple[str, int, int]


class Timing(NamedTuple):
    """One task as it ran: its rank, stage, kind, micro-batch, start and end."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def check_schedule(schedule: str, stages_per_rank: int) -> None:
    """Raise ``ValueError`` unless ``schedule`` is known and can run ``stages_per_rank`` stages on a rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
    if schedule in SINGLE and stages_per_rank != 1:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank}")
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(f"schedule={schedule!r} runs two stages per rank in a V, got {stages_per_rank=}")


def rank_orders(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """Every rank's compute tasks in the order torch 2.13's schedule runs them (idle slots dropped).

    Args:
        schedule: one of :data:`SCHEDULES`.
        n_ranks: pipeline ranks ``R``.
        n_microbatches: micro-batches per step ``M``.
        stages_per_rank: stages each rank holds (1 for GPipe/1F1B, 2 for the V schedules).

    Returns:
        Per rank, a list of ``(kind, stage, microbatch)``.

    Raises:
        ValueError: for an unknown schedule, a stage count it cannot run, or (DualPipeV) ``M < 2 R``.
    """
    check_schedule(schedule, stages_per_rank)
    if schedule in SINGLE:
        return [[(k, r, m) for k, m in _single_order(r, n_ranks, n_microbatches, schedule)] for r in range(n_ranks)]
    if schedule == "zbv":
        return [_zbv_order(r, n_ranks, n_microbatches) for r in range(n_ranks)]
    if schedule == "dualpipev":
        if n_microbatches < 2 * n_ranks:
            raise ValueError(f"dualpipev needs n_microbatches >= 2 * n_ranks = {2 * n_ranks}, got {n_microbatches}")
        return [_dualpipev_order(r, n_ranks, n_microbatches) for r in range(n_ranks)]
    return [
        _interleaved_order(r, n_ranks, n_microbatches, stages_per_rank, schedule == "interleaved_zb")
        for r in range(n_ranks)
    ]


def _single_order(stage: int, n_stages: int, n_microbatches: int, schedule: str) -> list[tuple[str, int]]:
    forwards = [("F", m) for m in range(n_microbatches)]
    backwards = [("B", m) for m in range(n_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(n_microbatches, n_stages - stage)
    steady = [task for i in range(n_microbatches - warmup) for task in (backwards[i], forwards[warmup + i])]
    return forwards[:warmup] + steady + backwards[n_microbatches - warmup :]


def _interleaved_order(rank: int, n_ranks: int, n_micro: int, n_local: int, zero_bubble: bool) -> list[Action]:
    """``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``: torch's ``_get_1f1b_rank_ops``, no idles."""
    rounds = max(1, n_micro // n_ranks)
    if n_micro % rounds:
        raise ValueError(f"interleaved schedules need n_microbatches to be a multiple of {rounds}, got {n_micro}")
    per_round = n_micro // rounds
    # Warm-up forwards: the last rank's (n_local - 1) rounds plus 2 (1F1B) or 1 (zero bubble) per hop before it.
    factor = 1 if zero_bubble else 2
    warmup = min((n_local - 1) * per_round + factor * (n_ranks - 1 - rank), n_micro * n_local)
    total = n_local * n_micro
    fwd_bwd = total - warmup

    def fwd_stage(op: int) -> int:
        return (op // per_round) % n_local * n_ranks + rank

    def bwd_stage(op: int) -> int:
        return (n_local - 1 - ((op - warmup) // per_round) % n_local) * n_ranks + rank

    count: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Action:
        m = count.get((kind, stage), 0)
        count[kind, stage] = m + 1
        return (kind, stage, m)

    backward = "I" if zero_bubble else "B"
    ops: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            ops.append(take("F", fwd_stage(op)))
        if op >= warmup:
            ops.append(take(backward, bwd_stage(op)))
            backward_ops.append(op)
            # ZB1P: a rank delays its first `rank` weight parts, then runs one after every input part.
            if zero_bubble and op - warmup >= rank:
                ops.append(take("W", bwd_stage(backward_ops[weights])))
                weights += 1
    while zero_bubble and weights < len(backward_ops):
        ops.append(take("W", bwd_stage(backward_ops[weights])))
        weights += 1
    return ops


def _zbv_order(rank: int, n_ranks: int, n_micro: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations``, no idles (micro-batches past ``M`` dropped)."""
    n = max(2 * n_ranks - 1, n_micro)
    s0, s1 = rank, 2 * n_ranks - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (n_ranks - rank) - 1):
        ops.append(("F", s0, f0))
        f0 += 1
    for _ in range(rank):
        ops += [("F", s1, f1), ("F", s0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(n_ranks - rank):
        ops += [("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", s0, f0))
            f0 += 1
        ops += [("I", s0, b0), ("W", s0, b0), ("F", s1, f1), ("I", s1, b1), ("W", s1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [("I", s0, b0), ("I", s1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(n_ranks - rank):
        ops += [("I", s0, b0), ("W", s0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [("W", s1, m) for m in range(w1, b1)] + [("W", s0, m) for m in range(w0, b0)]
    return [a for a in ops if a[2] < n_micro]


def _dualpipev_order(rank: int, n_ranks: int, n_micro: int) -> list[Action]:
    """``ScheduleDualPipeV._calculate_single_rank_operations``, overlapped pairs flattened (forward first)."""
    s0, s1 = rank, 2 * n_ranks - 1 - rank
    count: dict[tuple[str, int], int] = {}
    weights: list[tuple[int, int]] = []
    ops: list[Action] = []

    def add(kind: str, stage: int) -> None:
        # A full backward advances the input and the weight counters together (torch counts both under "I").
        m = count.get(("I" if kind == "B" else kind, stage), 0)
        ops.append((kind, stage, m))
        if kind == "B":
            count["I", stage] = m + 1
            count["W", stage] = count.get(("W", stage), 0) + 1
        else:
            if kind == "I":
                weights.append((stage, m))
            count[kind, stage] = m + 1

    def weight() -> None:
        if weights:
            stage, m = weights.pop(0)
            ops.append(("W", stage, m))
            count["W", stage] = count.get(("W", stage), 0) + 1

    for _ in range(2 * (n_ranks - rank - 1)):
        add("F", s0)
    for _ in range(rank + 1):
        add("F", s0)
        add("F", s1)
    for _ in range(n_ranks - rank - 1):
        add("I", s1)
        weight()
        add("F", s1)
    for _ in range(n_micro - 2 * n_ranks + rank + 1):
        add("F", s0)
        add("B", s1)  # torch overlaps this pair except for the last rank's first one: serially either way
        add("F", s1)
        add("B", s0)
    for _ in range(n_ranks - rank - 1):
        add("B", s1)
        add("F", s1)
        add("B", s0)
    _dualpipev_drain(rank, n_ranks, add, weight)
    return ops


def _dualpipev_drain(rank: int, n_ranks: int, add: Callable[[str, int], None], weight: Callable[[], None]) -> None:
    """The cool-down of a DualPipeV rank: the last backwards of its two stages, then the delayed weight parts.

    Args:
        rank: the rank whose order is built.
        n_ranks: pipeline ranks ``R``.
        add: appends a task of a kind on a stage to the rank's order (counting its micro-batch).
        weight: appends the oldest delayed ``W`` task, if any.
    """
    s0, s1 = rank, 2 * n_ranks - 1 - rank
    zero_bubble = False
    steps = rank + 1
    for i in range(steps):
        # Halfway through, torch switches to split backwards: odd ranks before their second stage's, even after.
        if i == steps // 2 and rank % 2 == 1:
            zero_bubble = True
        add("I" if zero_bubble else "B", s1)
        if i == steps // 2 and rank % 2 == 0:
            zero_bubble = True
        add("I" if zero_bubble else "B", s0)
    for _ in range(n_ranks - rank - 1):
        weight()
        add("I" if zero_bubble else "B", s0)
    for _ in range(rank + 1):
        weight()


# ---------------------------------------------------------------------------------------------------------------------
def execute(
    orders: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    fwd: np.ndarray,
    bwd: np.ndarray,
    wgt: np.ndarray,
    p2p: float,
    record: bool = False,
) -> tuple[float, list[Timing]]:
    """Play the task orders out: the makespan, and (with ``record``) every task's timing.

    Args:
        orders: per rank, its tasks in order (:func:`rank_orders`).
        ranks: the rank of every stage.
        fwd: forward time per stage and micro-batch, ``[S][M]``.
        bwd: full backward time per stage and micro-batch (input and weight parts together), ``[S][M]``.
        wgt: the weight part of ``bwd`` (a ``W`` task takes it, an ``I`` task takes ``bwd - wgt``), ``[S][M]``.
        p2p: time of one hop between ranks.
        record: also return every task's :class:`Timing`.

    Returns:
        ``(makespan, timings)`` (``timings`` empty unless ``record``).

    Raises:
        RuntimeError: if the orders deadlock (a task waits for one that comes later on its own rank).
    """
    plan = _task_plan(ranks, fwd, bwd, wgt, p2p)
    position = [0] * len(orders)
    free = [0.0] * len(orders)
    waiting: dict[tuple[int, int, int], int] = {}  # (0: forward / 1: gradient, stage, micro-batch) -> blocked rank
    timings: list[Timing] = []
    todo = list(range(len(orders)))
    remaining = sum(len(o) for o in orders)
    # The hot loop: every task is one table lookup and no call (a call per task made simulations ~40 % slower).
    while todo:
        r = todo.pop()
        order, t = orders[r], free[r]
        while position[r] < len(order):
            kind, s, m = order[position[r]]
            dep, source, extra, took, out_row, out = plan[kind][s]
            ready = dep[m]
            if ready < 0:
                waiting[(*source, m)] = r
                break
            ready += extra
            start = t if t > ready else ready
            t = start + took[m]
            woken = r  # nobody else to wake unless a rank waits for this task's output
            if out_row is not None:
                out_row[m] = t
                woken = waiting.pop((out, s, m), r)
            position[r] += 1
            remaining -= 1
            if record:
                timings.append(Timing(r, s, kind, m, start, t))
            if woken != r:
                todo.append(woken)
        free[r] = t
    if remaining:
        raise RuntimeError(f"schedule deadlocked at positions {position}")
    return (max(free) if free else 0.0), timings


#: What the event engine needs to run one task kind on one stage: the done-time row its input waits on, the
#: ``(table, stage)`` a blocked rank waits under (table 0: forwards, 1: input gradients), the hop before the input
#: is there, the task's time per micro-batch, the done-time row it writes (``None``: none) and that row's table.
_TaskPlan = tuple[list[float], tuple[int, int], float, list[float], list[float] | None, int | None]


def _task_plan(
    ranks: Sequence[int], fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray, p2p: float
) -> dict[str, list[_TaskPlan]]:
    """Per task kind (``"F"``, ``"B"``, ``"I"``, ``"W"``) and stage, the :data:`_TaskPlan` of :func:`execute`.

    Args:
        ranks: the rank of every stage.
        fwd: forward time per stage and micro-batch, ``[S][M]``.
        bwd: full backward time per stage and micro-batch, ``[S][M]``.
        wgt: the weight part of ``bwd``, ``[S][M]``.
        p2p: time of one hop between ranks.

    Returns:
        The plans, by kind, then by stage. Their done-time rows start at ``-1`` (not done yet) and are shared: the
        engine's writes to them are what later tasks wait on.
    """
    n_stages, n_micro = fwd.shape
    last = n_stages - 1
    # An input part takes b - w: one IEEE float64 subtraction per element, as the engine once took it per task.
    f, b, w, i = fwd.tolist(), bwd.tolist(), wgt.tolist(), np.subtract(bwd, wgt, dtype=np.float64).tolist()
    done_f = [[-1.0] * n_micro for _ in range(n_stages)]
    done_g = [[-1.0] * n_micro for _ in range(n_stages)]  # the stage's input gradient is out (B or I ended)
    # Stage 0's forwards wait for nothing: a row that is always ready, with no hop, starts them at 0 as before.
    ready = [0.0] * n_micro
    cross = [p2p if ranks[s] != ranks[s + 1] else 0.0 for s in range(last)]  # the hop between s and s + 1
    plan: dict[str, list[_TaskPlan]] = {"F": [], "B": [], "I": [], "W": []}
    for s in range(n_stages):
        if s:
            plan["F"].append((done_f[s - 1], (0, s - 1), cross[s - 1], f[s], done_f[s], 0))
        else:
            plan["F"].append((ready, (0, -1), 0.0, f[s], done_f[s], 0))
        # A backward waits for the next stage's input gradient; on the last stage, for its own forward.
        grad = (done_f[s], (0, s), 0.0) if s == last else (done_g[s + 1], (1, s + 1), cross[s])
        plan["B"].append((*grad, b[s], done_g[s], 1))
        plan["I"].append((*grad, i[s], done_g[s], 1))
        plan["W"].append((done_g[s], (1, s), 0.0, w[s], None, None))
    return plan


def makespan(
    stage_fwd: Sequence[float] | Sequence[Sequence[float]],
    stage_bwd: Sequence[float] | Sequence[Sequence[float]],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    *,
    stage_wgt: Sequence[float] | Sequence[Sequence[float]] | None = None,
    stages_per_rank: int = 1,
) -> float:
    """Time of one training step under the schedule's own task order (see the module docstring).

    Args:
        stage_fwd: forward time of each stage for one micro-batch: ``[S]``, or ``[S][M]`` per micro-batch.
        stage_bwd: full backward time of each stage (input and weight gradients), shaped like ``stage_fwd``.
        n_microbatches: micro-batches per step ``M >= 1``.
        schedule: one of :data:`SCHEDULES`.
        p2p: time of one hop between ranks.
        stage_wgt: the weight-gradient part of ``stage_bwd`` that zero-bubble schedules run as separate ``W``
            tasks (``None``: 0, the whole backward is the input part); ignored by schedules without ``W`` tasks.
        stages_per_rank: stages per rank ``S / R`` (placement
        :func:`~dynmo_lightning.balance.split.placement.stage_ranks`).

    Returns:
        The makespan: when the last task on any rank ends.

    Raises:
        ValueError: for invalid times or shapes, a weight part above its backward, ``M < 1``, a negative ``p2p``,
            an unknown schedule, or a stage count that is not ``stages_per_rank`` times the ranks.
    """
    return timeline(
        stage_fwd, stage_bwd, n_microbatches, schedule, p2p, stage_wgt=stage_wgt, stages_per_rank=stages_per_rank
    )[0]


def timeline(
    stage_fwd: Sequence[float] | Sequence[Sequence[float]],
    stage_bwd: Sequence[float] | Sequence[Sequence[float]],
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    *,
    stage_wgt: Sequence[float] | Sequence[Sequence[float]] | None = None,
    stages_per_rank: int = 1,
    record: bool = False,
) -> tuple[float, list[Timing]]:
    """:func:`makespan`, and with ``record`` every task's :class:`Timing` (arguments as :func:`makespan`)."""
    m_count = microbatches(n_microbatches)
    if not (math.isfinite(p2p) and p2p >= 0):
        raise ValueError(f"p2p must be a finite time >= 0, got {p2p!r}")
    fwd = per_microbatch(stage_fwd, "stage_fwd", m_count)
    bwd = per_microbatch(stage_bwd, "stage_bwd", m_count)
    if fwd.shape[0] != bwd.shape[0]:
        raise ValueError(f"{len(fwd)} stage forward times but {len(bwd)} backward times: give one of each per stage")
    wgt = np.zeros_like(bwd) if stage_wgt is None else per_microbatch(stage_wgt, "stage_wgt", m_count)
    if wgt.shape != bwd.shape:
        raise ValueError(f"stage_wgt has shape {wgt.shape} but stage_bwd {bwd.shape}: give one per stage")
    if np.any(wgt > bwd * (1 + 1e-12)):
        raise ValueError("stage_wgt is the weight part of stage_bwd: it cannot exceed it")
    check_schedule(schedule, stages_per_rank)
    if fwd.shape[0] % stages_per_rank:
        raise ValueError(f"{fwd.shape[0]} stages do not fill {stages_per_rank} stages on every rank")
    n_ranks = fwd.shape[0] // stages_per_rank
    orders = rank_orders(schedule, n_ranks, m_count, stages_per_rank)
    if schedule not in ZERO_BUBBLE:
        wgt = np.zeros_like(bwd)  # no W tasks: the whole backward runs in B
    return execute(orders, stage_ranks(schedule, n_ranks, stages_per_rank), fwd, bwd, wgt, float(p2p), record)


def lower_bound(
    stage_fwd: Sequence[float],
    stage_bwd: Sequence[float],
    n_microbatches: int,
    ranks: Sequence[int],
    stage_input: Sequence[float] | None = None,
) -> float:
    """A bound no schedule beats: each rank runs all its stages' tasks one at a time after the first input arrives.

    ``max_r [sum of the forwards before r's first stage + M * sum over r's stages of (f + b)]``; hops only add.
    With one stage per rank and ``stage_input`` (each stage's backward-input time, its full backward where the
    schedule does not split it), the last backward-input of stage ``s`` must still cross the stages before it, which
    adds ``sum_{j<s} stage_input[j]`` when the stage's last task is that backward (no weight part after it).
    """
    first: dict[int, int] = {}
    load: dict[int, float] = {}
    for s, r in enumerate(ranks):
        first.setdefault(r, s)
        load[r] = load.get(r, 0.0) + stage_fwd[s] + stage_bwd[s]
    prefix = np.concatenate([[0.0], np.cumsum(stage_fwd)])
    bound = max(float(prefix[first[r]]) + n_microbatches * load[r] for r in load)
    if stage_input is not None and len(load) == len(ranks):
        tail = np.concatenate([[0.0], np.cumsum(stage_input)])
        for s in range(len(ranks)):
            if stage_input[s] >= stage_bwd[s]:  # no weight part may run after the stage's last backward
                busy = float(prefix[s]) + n_microbatches * (stage_fwd[s] + stage_bwd[s])
                bound = max(bound, busy + float(tail[s]))
    return bound


def microbatches(n_microbatches: int) -> int:
    """``n_microbatches`` as an ``int >= 1``, else ``ValueError``."""
    if isinstance(n_microbatches, bool) or operator.index(n_microbatches) < 1:
        raise ValueError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
    return operator.index(n_microbatches)


def per_microbatch(values: Sequence[float] | Sequence[Sequence[float]], name: str, n_microbatches: int) -> np.ndarray:
    """Per-stage times as a ``[S][M]`` array: 1-D input repeats for every micro-batch."""
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
