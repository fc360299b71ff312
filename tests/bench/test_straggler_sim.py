"""A straggler in the simulated pipeline: its speed schedule, its events, and one small row (synthetic, no timing)."""

from __future__ import annotations

import math

import pytest

from dynmo_lightning.bench.scale import Network
from dynmo_lightning.bench.straggler_sim import (
    ROW_KEYS,
    events,
    every_kth,
    finish_row,
    straggler_speeds,
    sweep,
)

NET = Network(p2p_latency=1e-4, p2p_bandwidth=1e9, migration_bandwidth=1e9)


def constant_trace(n_steps: int = 60, n_layers: int = 16) -> list[dict]:
    """Equal layers that never change: any imbalance is the straggler's."""
    return [
        {
            "step": step,
            "fwd": [1.0] * n_layers,
            "bwd": [2.0] * n_layers,
            "param_bytes": [1e6] * n_layers,
            "optim_bytes": [2e6] * n_layers,
            "activation_bytes": [1e6] * n_layers,
            "changed_layers": [],
        }
        for step in range(n_steps)
    ]


def test_steady_straggler_slows_one_rank_from_its_start_on():
    speeds = straggler_speeds(4, 2, 0.5, "steady", start=3, period=5)
    assert [speeds(k) for k in (0, 2)] == [[1.0] * 4] * 2
    assert speeds(3) == speeds(299) == [1.0, 1.0, 0.5, 1.0]
    assert events(10, 3, "steady", 5) == [3]


def test_intermittent_straggler_alternates_slow_and_normal_windows():
    speeds = straggler_speeds(3, 1, 0.7, "intermittent", start=3, period=2)
    slow = [speeds(k)[1] for k in range(11)]
    assert slow == [1.0, 1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 0.7, 0.7, 1.0, 1.0]
    assert all(speeds(k)[0] == speeds(k)[2] == 1.0 for k in range(11))
    # onset, recovery, onset, recovery: every change of the slow rank's speed, none before the start
    assert events(11, 3, "intermittent", 2) == [3, 5, 7, 9]
    assert events(3, 3, "intermittent", 2) == []  # the trace ends before the straggler starts
    assert events(4, 0, "steady", 2) == [0]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4, 4, 0.5, "steady", 0, 1), "rank=4"),
        ((4, 1, 0.0, "steady", 0, 1), "speed=0.0"),
        ((4, 1, 1.5, "steady", 0, 1), "speed=1.5"),
        ((4, 1, 0.5, "sometimes", 0, 1), "pattern='sometimes'"),
        ((4, 1, 0.5, "intermittent", 0, 0), "period=0"),
    ],
)
def test_straggler_speeds_refuses_what_no_pipeline_runs(args, match):
    with pytest.raises(ValueError, match=match):
        straggler_speeds(*args)


def test_every_kth_keeps_the_dynamics_events_of_dropped_steps():
    trace = constant_trace(n_steps=7, n_layers=4)
    trace[3]["changed_layers"] = [1, 2]
    trace[4]["changed_layers"] = [0]
    thinned = every_kth(trace, 3)
    assert [e["step"] for e in thinned] == [0, 3, 6]
    # the events of steps 4 (dropped) reach step 6, those of step 3 stay on it
    assert [e["changed_layers"] for e in thinned] == [[], [1, 2], [0]]
    assert every_kth(trace, 1) == trace
    with pytest.raises(ValueError, match="stride"):
        every_kth(trace, 0)


def test_moves_per_event_counts_only_the_moves_beyond_the_run_without_a_straggler():
    row = dict.fromkeys(ROW_KEYS, 1.0) | {"n_migrations": 5, "n_events": 2}
    assert finish_row(row, 1)["moves_per_event"] == 2.0
    assert finish_row(row, 7)["moves_per_event"] == 0.0  # clipped: fewer moves than without the straggler
    assert math.isnan(finish_row(row | {"n_events": 0}, 1)["moves_per_event"])


def test_dynmo_moves_layers_off_a_steady_straggler():
    # 16 equal layers on 4 stages; the middle rank (2) runs at half speed from step 12 of 60 on
    (row,) = sweep({"none": constant_trace()}, NET, stages=(4,), speeds=(0.5,), patterns=("steady",), every_n_steps=10)
    assert tuple(row) == ROW_KEYS
    assert (row["n_stages"], row["speed"], row["pattern"], row["dynamic"], row["n_events"]) == (
        4, 0.5, "steady", "none", 1,
    )  # fmt: skip
    # the uniform split waits on the slow stage; static_time planned before the straggler (equal layers: uniform)
    assert row["over_uniform"] > 1.2
    assert row["over_static_time"] == pytest.approx(row["over_uniform"])
    assert 0.0 < row["share_of_oracle"] <= 1.0 + 1e-9
    assert row["share_of_oracle"] > 0.9
    # one straggler, one change of speed: a move or two, not a chase (nothing moves without the straggler)
    assert 1 <= row["n_migrations"] <= 2 and row["moves_per_event"] <= 2.0
    # the speed-blind balancer is reported beside it, on the same scale
    assert row["blind_over_uniform"] > 0.0 and 0.0 < row["blind_share_of_oracle"] <= 1.0 + 1e-9
