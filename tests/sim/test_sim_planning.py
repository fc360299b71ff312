"""The planning-cost model: diffusion rounds between neighbours vs gather-and-plan, priced per message."""

from __future__ import annotations

import math

import pytest

from dynmo_lightning.balance import diffuse
from dynmo_lightning.sim import gather_plan_time, neighbour_plan_time


def test_neighbour_time_is_rounds_of_one_card_plus_the_termination_check():
    t = neighbour_plan_time(100, 432, 64, latency=1e-5, bandwidth=1e9, compute_s=0.5)
    assert t == pytest.approx(100 * (1e-5 + 432e-9) + 2 * 6 * 1e-5 + 0.5)
    assert neighbour_plan_time(0, 432, 1, latency=1e-5, bandwidth=1e9) == 0.0


def test_gather_time_is_log_p_latencies_the_missing_data_and_the_plan():
    t = gather_plan_time(1000, 64, 40, latency=1e-4, bandwidth=1e9, plan_s=0.002)
    assert t == pytest.approx(6 * 1e-4 + 1000 * 40 * 63 / 64 / 1e9 + 0.002)
    ring = gather_plan_time(1000, 64, 40, latency=1e-4, bandwidth=1e9, plan_s=0.002, ring=True)
    assert ring == pytest.approx(t + (63 - 6) * 1e-4)  # a ring all-gather: P - 1 latencies


def test_model_priced_with_the_protocols_real_rounds():
    costs = [float(c) for c in range(1, 65)]
    result = diffuse(costs, [8] * 8)
    slow, fast = (neighbour_plan_time(result.rounds, result.message_bytes, 8, latency=x, bandwidth=1e9)
                  for x in (1e-4, 1e-5))  # fmt: skip
    assert math.isclose(slow - fast, (result.rounds + 6) * 9e-5)
