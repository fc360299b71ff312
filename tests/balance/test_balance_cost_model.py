"""Pipeline cost model: hand-computed step times, a flow-shop cross-check, and the re-partition rule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_lightning.balance import bubble_fraction, should_repartition, stage_times, step_time


def test_stage_times_sum_each_stage():
    assert stage_times([1, 2, 3, 4], [2, 2, 2, 5], [1, 3]) == ([1.0, 9.0], [2.0, 9.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("n_stages", "n_microbatches", "p2p"), [(1, 1, 0.0), (4, 8, 0.0), (4, 8, 0.25), (3, 1, 1.0)])
def test_equal_stages_reduce_to_m_plus_p_minus_1(schedule, n_stages, n_microbatches, p2p):
    f, b = 2.0, 3.0
    expected = (n_microbatches + n_stages - 1) * (f + b) + 2 * (n_stages - 1) * p2p
    assert step_time([f] * n_stages, [b] * n_stages, n_microbatches, schedule, p2p) == pytest.approx(expected)
    busy = n_microbatches / (n_microbatches + n_stages - 1)
    if p2p == 0:
        assert bubble_fraction([f] * n_stages, [b] * n_stages, n_microbatches, schedule) == pytest.approx(1 - busy)


def test_heterogeneous_stages_by_hand():
    fwd, bwd, m = [1.0, 3.0], [3.0, 1.0], 3
    # GPipe: forward 4 + 2*3 = 10, backward 4 + 2*3 = 10.
    assert step_time(fwd, bwd, m, "gpipe") == 20.0
    # 1F1B: f+b = [4, 4]: 8 + 2*4 = 16; one hop each way adds 2 * 0.5.
    assert step_time(fwd, bwd, m, "1f1b") == 16.0
    assert step_time(fwd, bwd, m, "1f1b", p2p=0.5) == 17.0
    # Busy 3 * 8 = 24 of 2 * 16 = 32.
    assert bubble_fraction(fwd, bwd, m, "1f1b") == 0.25
    # Three stages: f+b = [3, 6, 9], M = 4: 18 + 3*9 = 45; hops 2*2*0.5 = 2.
    assert step_time([1, 2, 3], [2, 4, 6], 4, "1f1b", p2p=0.5) == 47.0
    assert step_time([1, 2, 3], [2, 4, 6], 4, "gpipe", p2p=0.5) == 47.0


def flow_shop_makespan(times, n_microbatches, p2p):
    """Each stage runs micro-batches in order, starting one once it has arrived from the previous stage."""
    done = [0.0] * len(times)
    for _ in range(n_microbatches):
        arrived = -p2p
        for stage, t in enumerate(times):
            done[stage] = max(done[stage], arrived + p2p) + t
            arrived = done[stage]
    return done[-1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=6),
    st.integers(1, 8),
    st.sampled_from([0.0, 0.5, 2.0]),
)
def test_gpipe_matches_a_flow_shop_simulation(stages, n_microbatches, p2p):
    fwd, bwd = [float(f) for f, _ in stages], [float(b) for _, b in stages]
    # Backward runs after the last forward and flows from the last stage to the first.
    expected = flow_shop_makespan(fwd, n_microbatches, p2p) + flow_shop_makespan(bwd[::-1], n_microbatches, p2p)
    assert step_time(fwd, bwd, n_microbatches, "gpipe", p2p) == pytest.approx(expected)


def test_should_repartition_weighs_saving_against_migration_and_gain():
    fwd, bwd = [1.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 10.0]
    common = {"n_microbatches": 4, "schedule": "1f1b"}
    # Current [2, 2]: stages f+b = [6, 18]: 24 + 3*18 = 78. Proposed [3, 1]: [9, 15]: 24 + 3*15 = 69.
    decision, saving = should_repartition(
        fwd, bwd, [2, 2], [3, 1], steps_until_next_check=10, migration_cost=50.0, min_gain=0.05, **common
    )
    assert (decision, saving) == (True, 90.0)
    assert should_repartition(
        fwd, bwd, [2, 2], [3, 1], steps_until_next_check=10, migration_cost=90.0, min_gain=0.05, **common
    ) == (False, 90.0)
    assert not should_repartition(
        fwd, bwd, [2, 2], [3, 1], steps_until_next_check=100, migration_cost=1.0, min_gain=9 / 78, **common
    )[0]
    decision, saving = should_repartition(
        fwd, bwd, [3, 1], [2, 2], steps_until_next_check=10, migration_cost=0.0, min_gain=0.0, **common
    )
    assert not decision and saving == -90.0


def decide(**overrides):
    args = {
        "n_microbatches": 1,
        "schedule": "1f1b",
        "steps_until_next_check": 1,
        "migration_cost": 0.0,
        "min_gain": 0.0,
        **overrides,
    }
    return should_repartition([1.0], [1.0], [1], [1], **args)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: step_time([1.0], [1.0], 2, "zero-bubble"),
            "unknown schedule 'zero-bubble'; valid schedules: gpipe, 1f1b",
        ),
        (lambda: step_time([1.0], [1.0], 0), "n_microbatches must be an integer >= 1"),
        (lambda: step_time([1.0], [1.0], 2, p2p=-1.0), "p2p must be a finite time >= 0"),
        (lambda: step_time([1.0, 2.0], [1.0], 2), "2 stage forward times but 1 backward times"),
        (lambda: step_time([], [], 2), "no stage times given"),
        (lambda: stage_times([1.0, -2.0], [1.0, 1.0], [1, 1]), r"layer forward times\[1\] = -2.0"),
        (lambda: stage_times([1.0, 2.0], [1.0, 1.0], [1, 2]), "sums to 3 but the model has 2 layers"),
        (lambda: decide(steps_until_next_check=-1), "steps_until_next_check must be an integer >= 0"),
        (lambda: decide(migration_cost=math.nan), "migration_cost must be finite and >= 0"),
        (lambda: decide(min_gain=-0.1), "min_gain must be finite and >= 0"),
    ],
)
def test_invalid_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
