"""The A/B summary: paired ratios, Student's t intervals, the ideal ratio of the window, the reaction lag."""

from __future__ import annotations

import statistics

import pytest

from dynmo_lightning.bench.real import ideal_ratio, interval95, summarize

LINK = {"p2p_latency_s": 0.0, "p2p_bytes": 0, "p2p_bytes_per_s": 1.0}


def test_interval_is_students_t():
    values = [1.0, 1.2, 1.1, 1.3, 1.4]
    mean, low, high = interval95(values)
    half = 2.776 * statistics.stdev(values) / 5**0.5  # t(0.975, 4 degrees of freedom)
    assert mean == pytest.approx(1.2) and low == pytest.approx(1.2 - half) and high == pytest.approx(1.2 + half)


def test_ideal_ratio_from_the_window_costs():
    # four equal layers, the first two frozen (forward only): uniform [2, 2] carries 2 vs 6, optimal [3, 1] 5 vs 3
    costs = {"fwd": [1.0] * 4, "bwd": [0.0, 0.0, 2.0, 2.0]}
    m = 4
    uniform = (2 + 6) + (m - 1) * 6
    best = (5 + 3) + (m - 1) * 5
    assert ideal_ratio(costs, 2, m, 0.0) == pytest.approx(uniform / best)


def test_summary_pairs_repeats_and_finds_the_lag():
    cases, results = [], {}
    for repeat, (u, d) in enumerate([(100.0, 120.0), (110.0, 125.0)]):
        for policy, speed in (("uniform", u), ("optimal", d)):
            name = f"freezing-{policy}-{repeat}"
            cases.append({"name": name, "dynamic": "freezing", "policy": policy, "repeat": repeat,
                          "world_size": 2, "microbatches": 4})  # fmt: skip
            results[name] = {"tokens_per_s": speed, "val_loss": 2.0, "partitions": [], "events": [10, 11, 25],
                             "moves": [14, 28]}  # fmt: skip
            if policy == "optimal":
                results[name] |= {"profile_every_n_steps": 5, "window_costs": {"fwd": [1.0] * 4, "bwd": [0.0] * 4}}
    rows = {r["policy"]: r for r in summarize(cases, results, LINK)}
    dynmo = rows["optimal"]
    assert dynmo["ratios"] == pytest.approx([1.2, 125 / 110])
    assert dynmo["ideal_ratio"] == pytest.approx(1.0) and rows["uniform"]["ratio"] == 1.0
    # bursts end at steps 11 and 25; the moves follow 3 steps later: 3 steps = 0.6 profile intervals
    assert dynmo["reaction_lag_steps"] == {"max_steps": 3, "profile_interval": 5, "max_intervals": 0.6}
