"""The A/B summary: paired ratios, Student's t intervals, the ideal ratio of the window, the reaction lag."""

from __future__ import annotations

import itertools
import statistics

import pytest

from dynmo_lightning.balance import stage_times, step_time
from dynmo_lightning.bench.real import ideal_ratio, interval95, summarize
from dynmo_lightning.sim import simulate_layers

LINK = {"p2p_latency_s": 0.0, "p2p_bytes": 0, "p2p_bytes_per_s": 1.0}


def test_interval_is_students_t():
    values = [1.0, 1.2, 1.1, 1.3, 1.4]
    mean, low, high = interval95(values)
    half = 2.776 * statistics.stdev(values) / 5**0.5  # t(0.975, 4 degrees of freedom)
    assert mean == pytest.approx(1.2) and low == pytest.approx(1.2 - half) and high == pytest.approx(1.2 + half)


def test_ideal_ratio_from_the_window_costs():
    # four equal layers, the first two frozen (forward only). Uniform [2, 2]: stage 0 runs F=2, B=0, stage 1 F=2,
    # B=4: the last stage paces the step, 8 + 3 * 6 = 26 (closed form and schedule agree). The best split, [3, 1]
    # (F=3, B=2 | F=1, B=2), runs in 21 in Schedule1F1B's order (stage 0: F0 0-3, F1 3-6, B0 6-8, F2 8-11, B1 11-13,
    # F3 13-16, B2 16-18, B3 19-21) where the closed form says 8 + 3 * 5 = 23: its heavy first stage overlaps fill.
    costs = {"fwd": [1.0] * 4, "bwd": [0.0, 0.0, 2.0, 2.0]}
    assert step_time(*stage_times(costs["fwd"], costs["bwd"], [3, 1]), 4, "1f1b", 0.0) == pytest.approx(23)
    assert ideal_ratio(costs, 2, 4, 0.0) == pytest.approx(26 / 21)


def test_ideal_ratio_searches_every_split_when_few():
    # a heavy first layer: at one micro-batch every split takes the whole sum, so nothing beats uniform
    costs = {"fwd": [3.0, 1.0, 1.0, 1.0, 1.0], "bwd": [6.0, 2.0, 2.0, 2.0, 2.0]}
    assert ideal_ratio(costs, 2, 1, 0.0) == pytest.approx(1.0)
    assert ideal_ratio(costs, 3, 8, 0.0) >= 1.0


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
    lag = {"max_steps": 3, "profile_interval": 5, "max_intervals": 0.6, "answered": 4, "events": 4}
    assert dynmo["reaction_lag_steps"] == lag
    # a burst that no move answered before the next one has no lag (its checks kept the split); it is counted
    results["freezing-optimal-1"]["moves"] = [28]
    rows = {r["policy"]: r for r in summarize(cases, results, LINK)}
    assert rows["optimal"]["reaction_lag_steps"] == lag | {"answered": 3}


def test_zero_bubble_cases_get_the_ideal_of_their_own_schedule():
    # eight layers, the first six frozen (forward only), under ZBV (two ranks, four stages in a V: rank 0 holds the
    # first and the last stage, so freezing only the first half would leave the ranks even): the ideal is the uniform
    # split's ZBV makespan over the best split's, every split timed with the weight parts of the backward
    fwd, bwd, wgt = [1.0] * 8, [0.0] * 6 + [2.0] * 2, [0.0] * 6 + [1.0] * 2
    costs = {"fwd": fwd, "bwd": bwd, "wgt": wgt}
    splits = [[b - a for a, b in itertools.pairwise((0, *c, 8))] for c in itertools.combinations(range(1, 8), 3)]

    def zbv(split: list[int]) -> float:
        return simulate_layers(fwd, bwd, split, 4, "zbv", 0.0, layer_wgt=wgt, stages_per_rank=2).step_time

    expected = zbv([2, 2, 2, 2]) / min(map(zbv, splits))
    assert expected > 1.05  # the frozen half is worth rebalancing
    assert ideal_ratio(costs, 2, 4, 0.0, "zbv", 2) == pytest.approx(expected)
    cases, results = [], {}
    for policy, speed in (("uniform", 100.0), ("optimal", 120.0)):
        name = f"freezing-{policy}-0"
        cases.append({"name": name, "dynamic": "freezing", "policy": policy, "repeat": 0, "world_size": 2,
                      "microbatches": 4, "schedule": "zbv", "stages_per_rank": 2})  # fmt: skip
        results[name] = {"tokens_per_s": speed, "val_loss": 2.0, "partitions": [], "events": [], "moves": [],
                         "window_costs": costs}  # fmt: skip
    rows = {r["policy"]: r for r in summarize(cases, results, LINK)}
    assert rows["optimal"]["ratio"] == pytest.approx(1.2)
    assert rows["optimal"]["ideal_ratio"] == pytest.approx(expected)
    assert rows["optimal"]["share_of_ideal"] == pytest.approx(1.2 / expected)
