"""Cost drift: the blocks' spread over a trace, a fixed split's stage loads, the experts' spread, the tables."""

from __future__ import annotations

import numpy as np
import pytest
from support.bench_data import write_bench_dir

from dynmo_lightning.bench import read_json
from dynmo_lightning.bench.drift import (
    drift_section,
    expert_spread,
    layer_drift,
    split_drift,
    sweep_drift_table,
    sweep_stages,
)
from dynmo_lightning.plots import DASH, TIMES
from dynmo_lightning.sim import load_trace


def _trace(rows: list[list[float]]) -> list[dict]:
    """A trace whose layers cost ``rows[step]`` (all of it forward: the drift adds forward and backward)."""
    return [{"step": k, "fwd": list(row), "bwd": [0.0] * len(row)} for k, row in enumerate(rows)]


def test_layer_drift_leaves_the_ends_out_and_compares_the_first_and_last_tenth():
    # 10 steps: the start is step 0, the end step 9; the embedding (5.0) and the head (7.0) never count.
    blocks_start, blocks_end = [1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 2.0]
    rows = [[5.0, *blocks_start, 7.0]] * 9 + [[5.0, *blocks_end, 7.0]]
    drift = layer_drift(_trace(rows))
    assert drift.cv_start == 0.0
    assert drift.cv_end == pytest.approx(np.std(blocks_end) / np.mean(blocks_end))
    assert (drift.change_min, drift.change_max) == (0.5, 2.0)
    assert drift.total_change == pytest.approx(sum(blocks_end) / sum(blocks_start))


def test_layer_drift_averages_its_windows():
    rows = [[1.0, 1.0]] * 10 + [[1.0, 3.0]] * 10  # window 0.5: the first ten steps against the last ten
    drift = layer_drift(_trace(rows), ends=0, window=0.5)
    assert (drift.change_min, drift.change_max) == (1.0, 3.0)


def test_split_drift_against_the_best_split_of_every_step():
    # Four equal layers on [2, 2] are balanced; when the first two drop to 0.1 the best split is [3, 1].
    rows = [[1.0] * 4] * 5 + [[0.1, 0.1, 1.0, 1.0]] * 5
    drift = split_drift(_trace(rows), [2, 2])
    assert drift.spread_start == 1.0
    assert drift.spread_end == pytest.approx(2.0 / 0.2)
    # the split's slowest stage is 2.0 at every step; the best one's 2.0 before and 1.2 ([0.1 + 0.1 + 1, 1]) after
    assert drift.excess == pytest.approx(10 * 2.0 / (5 * 2.0 + 5 * 1.2))
    assert drift.slowest_end == 1


def test_split_drift_of_a_split_that_stays_balanced():
    rows = [[1.0, 2.0, 1.0, 2.0]] * 3 + [[0.5, 1.0, 0.5, 1.0]] * 3  # every layer halves: the split stays optimal
    drift = split_drift(_trace(rows), [2, 2])
    assert drift.spread_start == drift.spread_end == 1.0
    assert drift.excess == 1.0


def test_expert_spread_is_the_busiest_expert_over_the_mean():
    states = [
        {"experts": [None, [0.5, 0.25, 0.25, 0.0], None]},  # 0.5 of 1.0 over 4 experts: 2x the mean
        {"experts": [None, [0.25, 0.25, 0.25, 0.25], None]},  # even: 1x
    ]
    assert expert_spread({"states": states}) == pytest.approx(1.5)
    assert expert_spread({"states": [{"experts": [None, None]}]}) is None


def test_sweep_stages_is_the_p_whose_oracle_the_preset_point_repeats():
    entry = {
        "strength": 0.5,
        "by_stages": {"8": {"oracle": {"speedup": 1.2}}, "16": {"oracle": {"speedup": 1.3}}},
        "strength_sweep": [{"strength": 0.25, "oracle_speedup": 1.2}, {"strength": 0.5, "oracle_speedup": 1.3}],
    }
    assert sweep_stages(entry) == "16"
    assert sweep_stages({**entry, "strength_sweep": []}) is None


def test_drift_section_of_a_bench_dir(tmp_path):
    d = write_bench_dir(tmp_path)
    sim = read_json(d / "simulated.json")
    lines = drift_section(d, sim)
    rows = [line for line in lines if line.startswith("| freezing")]
    assert len(rows) == 1
    # the synthetic freezing trace: half the layers lose their backward (2 of 3 of their cost) at step 20 of 60
    drift = layer_drift(load_trace(d / "traces" / "freezing.jsonl.gz"))
    assert f"{drift.cv_start:.2f} → {drift.cv_end:.2f}" in rows[0]
    cmp = sim["dynamics"]["freezing"]["by_stages"]["4"]
    room = cmp["policies"]["static_time"]["total_time"] / cmp["oracle"]["total_time"]
    assert f"{room:.2f}{TIMES}" in rows[0]
    assert drift_section(tmp_path / "missing", sim) == []


def test_sweep_drift_table_has_a_row_per_strength():
    sim = {"dynamics": {"freezing": {"strength_sweep": [{"strength": 40.0, "oracle_speedup": 1.25}]}}}
    rows = [[1.0, 1.0, 1.0, 1.0]] * 9 + [[1.0, 0.5, 1.0, 1.0]]
    lines = sweep_drift_table(sim, {"freezing": [(40.0, _trace(rows))]})
    assert len(lines) == 3
    assert lines[2].startswith("| freezing | percentile 40 | 0.00 → ")
    assert f"| 0.50{DASH}1.00 | 0.75 | 1.25{TIMES} |" in lines[2]
    assert sweep_drift_table(sim, {}) == []
