"""Simulator schedules: hand-computed steps and the execution rules on random pipelines."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_lightning.sim import Task, schedule_order, simulate, simulate_layers


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(1, 1), (1, 5), (2, 2), (3, 3), (4, 8), (5, 12)])
def test_1f1b_equal_stages_is_m_plus_p_minus_1(n_stages, n_microbatches):
    f, b = 2.0, 3.0
    result = simulate([f] * n_stages, [b] * n_stages, n_microbatches, "1f1b")
    assert result.step_time == (n_microbatches + n_stages - 1) * (f + b)
    assert result.busy == [n_microbatches * (f + b)] * n_stages


@pytest.mark.parametrize(("n_stages", "n_microbatches"), [(1, 3), (2, 1), (4, 2), (5, 3), (3, 3), (4, 8)])
def test_gpipe_equal_stages_is_m_plus_p_minus_1(n_stages, n_microbatches):
    f, b = 1.5, 2.5
    result = simulate([f] * n_stages, [b] * n_stages, n_microbatches, "gpipe")
    assert result.step_time == (n_microbatches + n_stages - 1) * (f + b)
    assert result.bubble_fraction == pytest.approx(1 - n_microbatches / (n_microbatches + n_stages - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_p2p_adds_fill_and_drain_hops_by_hand(schedule):
    # P=2, M=2, f=b=1, one hop = 1. Stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [2,3], then
    # 1F1B: B0 [3,4] F1 [4,5] B1 [5,6]; stage 0: B0 [5,6] (hop after 4), B1 [7,8] (hop after 6);
    # GPipe: F1 [3,4] B0 [4,5] B1 [5,6]; stage 0: B0 [6,7] (hop after 5), B1 [7,8] (hop after 6).
    # Either way (M + P - 1)(f + b) + 2 (P - 1) p2p = 8.
    result = simulate([1, 1], [1, 1], 2, schedule, p2p=1.0)
    assert result.step_time == 8.0
    assert [(t.stage, t.kind, t.microbatch) for t in result.timeline if t.stage == 0] == [
        (0, "F", 0),
        (0, "F", 1),
        (0, "B", 0),
        (0, "B", 1),
    ]
    backward_starts = [5.0, 7.0] if schedule == "1f1b" else [6.0, 7.0]
    assert [t.start for t in result.timeline if t.stage == 0 and t.kind == "B"] == backward_starts


def test_heterogeneous_two_stages_by_hand():
    fwd, bwd = [1, 3], [3, 1]
    # 1F1B, M=3. Stage 0 order F0 F1 B0 F2 B1 B2, stage 1 order F0 B0 F1 B1 F2 B2:
    # s0 F0 [0,1] F1 [1,2]; s1 F0 [1,4] B0 [4,5] F1 [5,8] B1 [8,9]; s0 B0 [5,8] F2 [8,9] B1 [9,12];
    # s1 F2 [9,12] B2 [12,13]; s0 B2 [13,16].
    result = simulate(fwd, bwd, 3, "1f1b")
    assert result.step_time == 16.0
    assert [(t.kind, t.microbatch, t.start, t.end) for t in result.timeline if t.stage == 1] == [
        ("F", 0, 1.0, 4.0),
        ("B", 0, 4.0, 5.0),
        ("F", 1, 5.0, 8.0),
        ("B", 1, 8.0, 9.0),
        ("F", 2, 9.0, 12.0),
        ("B", 2, 12.0, 13.0),
    ]
    assert result.busy == [12.0, 12.0]
    assert result.bubble_fraction == 1 - 24 / 32
    # With one hop of 0.5 every wait grows: s1 F0 [1.5,4.5] B0 [4.5,5.5] F1 [5.5,8.5] B1 [8.5,9.5];
    # s0 B0 [6,9] F2 [9,10] B1 [10,13]; s1 F2 [10.5,13.5] B2 [13.5,14.5]; s0 B2 [15,18].
    assert simulate(fwd, bwd, 3, "1f1b", p2p=0.5).step_time == 18.0
    # GPipe: forwards s0 [0,3], s1 F0 [1,4] F1 [4,7] F2 [7,10]; backwards s1 [10,13], s0 B0 [11,14] .. B2 [17,20].
    assert simulate(fwd, bwd, 3, "gpipe").step_time == 20.0


def test_1f1b_order_matches_schedule1f1b():
    orders = schedule_order(4, 6, "1f1b")
    for s, order in enumerate(orders):
        warmup = min(6, 4 - s)
        assert order[:warmup] == [("F", m) for m in range(warmup)]
        assert order[warmup] == ("B", 0)
        assert sorted(order) == sorted([("F", m) for m in range(6)] + [("B", m) for m in range(6)])
    assert orders[3] == [(k, m) for m in range(6) for k in "FB"]  # last stage: strict alternation
    assert schedule_order(4, 2, "1f1b")[0] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # M < P: warm-up is M


def test_per_microbatch_costs_and_layers():
    # A micro-batch that routes more tokens through stage 1 is slower there only.
    fwd = [[1, 1], [1, 3]]
    bwd = [[1, 1], [1, 1]]
    result = simulate(fwd, bwd, 2, "gpipe")
    assert result.busy == [4.0, 6.0]
    # s0 F [0,1][1,2]; s1 F0 [1,2] F1 [2,5] B0 [5,6] B1 [6,7]; s0 B0 [6,7] B1 [7,8].
    assert result.step_time == 8.0
    per_layer = simulate_layers([[1, 1], [0, 0], [1, 3]], [[1, 1], [0, 0], [1, 1]], [2, 1], 2, "gpipe")
    assert per_layer == result
    assert simulate_layers([1, 2, 3], [1, 1, 1], [1, 2], 4) == simulate([1, 5], [1, 2], 4)


def test_chrome_trace_lists_every_task():
    result = simulate([1, 2], [2, 1], 3)
    events = result.to_chrome_trace()["traceEvents"]
    assert len(events) == 12
    assert {e["tid"] for e in events} == {0, 1}
    assert events[0] == {"name": "F0", "cat": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1e6}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage_fwd": [1, -1], "stage_bwd": [1, 1]}, "finite and >= 0"),
        ({"stage_fwd": [1, 1], "stage_bwd": [1]}, "one of each per stage"),
        ({"stage_fwd": [], "stage_bwd": []}, "at least one stage"),
        ({"stage_fwd": [[1, 1]], "stage_bwd": [[1, 1]], "n_microbatches": 3}, "columns"),
        ({"stage_fwd": [1], "stage_bwd": [1], "n_microbatches": 0}, "n_microbatches"),
        ({"stage_fwd": [1], "stage_bwd": [1], "schedule": "zb"}, "unknown schedule"),
        ({"stage_fwd": [1], "stage_bwd": [1], "p2p": -1.0}, "p2p"),
    ],
)
def test_invalid_arguments(kwargs, match):
    args = {"n_microbatches": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate(**args)


@st.composite
def pipelines(draw):
    n_stages = draw(st.integers(1, 5))
    n_microbatches = draw(st.integers(1, 6))
    time = st.floats(0, 10, allow_nan=False) | st.integers(0, 4).map(float)
    per_microbatch = draw(st.booleans())
    shape = (n_stages, n_microbatches) if per_microbatch else (n_stages,)
    size = int(np.prod(shape))
    fwd = np.array(draw(st.lists(time, min_size=size, max_size=size))).reshape(shape)
    bwd = np.array(draw(st.lists(time, min_size=size, max_size=size))).reshape(shape)
    p2p = draw(st.sampled_from([0.0, 0.5, 1.0, 2.25]))
    return fwd, bwd, n_microbatches, draw(st.sampled_from(["gpipe", "1f1b"])), p2p


@settings(max_examples=100, deadline=None)
@given(pipelines())
def test_timeline_obeys_the_execution_rules(case):
    fwd, bwd, n_microbatches, schedule, p2p = case
    result = simulate(fwd, bwd, n_microbatches, schedule, p2p)
    n_stages = len(fwd)
    cost = {"F": np.broadcast_to(fwd.reshape(n_stages, -1), (n_stages, n_microbatches)), "B": None}
    cost["B"] = np.broadcast_to(bwd.reshape(n_stages, -1), (n_stages, n_microbatches))
    task: dict[tuple[str, int, int], Task] = {(t.kind, t.stage, t.microbatch): t for t in result.timeline}
    assert len(task) == len(result.timeline) == 2 * n_stages * n_microbatches
    assert [t.start for t in result.timeline] == sorted(t.start for t in result.timeline)
    orders = schedule_order(n_stages, n_microbatches, schedule)
    for s in range(n_stages):
        mine = [t for t in result.timeline if t.stage == s]
        mine.sort(key=lambda t: orders[s].index((t.kind, t.microbatch)))
        previous_end = 0.0
        for t in mine:
            assert t.end == t.start + cost[t.kind][s, t.microbatch]
            if t.kind == "F":
                ready = 0.0 if s == 0 else task["F", s - 1, t.microbatch].end + p2p
            elif s == n_stages - 1:
                ready = task["F", s, t.microbatch].end
            else:
                ready = task["B", s + 1, t.microbatch].end + p2p
            # Never before its dependency or the stage's previous task (no overlap), and never later than both.
            assert t.start == max(previous_end, ready)
            previous_end = t.end
        assert result.busy[s] == pytest.approx(math.fsum(cost["F"][s]) + math.fsum(cost["B"][s]))
    assert result.step_time == max(t.end for t in result.timeline)
    if result.step_time > 0:
        assert result.bubble_fraction == pytest.approx(1 - sum(result.busy) / (n_stages * result.step_time))
