"""The simulator against the analytic cost model ``balance.step_time``: where it is exact and how far it strays.

Findings (these tests pin them down):

* GPipe: the closed form is exact for per-stage constant times, heterogeneous stages and any ``p2p`` (each pass is
  a flow shop of identical jobs).
* 1F1B, ``p2p = 0``: exact with equal stages; with heterogeneous stages the simulated time is never below
  ``max_s [sum_{j<s} (f_j + b_j) + 2 s p2p + M (f_s + b_s)]`` (stage ``s`` cannot start before micro-batch 0
  reaches it, has ``M (f_s + b_s)`` of work, and its last backward still has to reach stage 0) and, on every
  random case tried, never above the GPipe time. It falls on either side of the closed form.
* 1F1B, ``p2p > 0``: stage ``s`` holds at most ``P - s`` micro-batches in flight, so the hops are not hidden in
  the steady state. Equal stages take ``(M + P - 1)(f + b) + 2 (P - 1) p2p + 2 p2p floor((M - 1)(P - 1) / P)``;
  the closed form drops the last term.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_lightning.balance import step_time
from dynmo_lightning.sim import simulate


def lower_bound(fwd, bwd, n_microbatches, p2p):
    return max(sum(fwd[:s]) + sum(bwd[:s]) + 2 * s * p2p + n_microbatches * (fwd[s] + bwd[s]) for s in range(len(fwd)))


@st.composite
def stages(draw, max_stages=6):
    n_stages = draw(st.integers(1, max_stages))
    time = st.integers(0, 8).map(float) | st.floats(0, 5, allow_nan=False)
    fwd = draw(st.lists(time, min_size=n_stages, max_size=n_stages))
    bwd = draw(st.lists(time, min_size=n_stages, max_size=n_stages))
    return fwd, bwd, draw(st.integers(1, 10))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n_microbatches", [1, 2, 4, 7, 16])
def test_equal_stages_exact_without_p2p(schedule, n_stages, n_microbatches):
    fwd, bwd = [1.25] * n_stages, [2.5] * n_stages
    simulated = simulate(fwd, bwd, n_microbatches, schedule).step_time
    assert simulated == step_time(fwd, bwd, n_microbatches, schedule)


@settings(max_examples=100, deadline=None)
@given(stages(), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_gpipe_matches_the_closed_form(case, p2p):
    fwd, bwd, n_microbatches = case
    simulated = simulate(fwd, bwd, n_microbatches, "gpipe", p2p).step_time
    assert simulated == pytest.approx(step_time(fwd, bwd, n_microbatches, "gpipe", p2p), rel=1e-12, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(stages(), st.sampled_from(["gpipe", "1f1b"]), st.sampled_from([0.0, 0.5, 2.0]))
def test_never_below_the_work_bound(case, schedule, p2p):
    fwd, bwd, n_microbatches = case
    simulated = simulate(fwd, bwd, n_microbatches, schedule, p2p).step_time
    assert simulated >= lower_bound(fwd, bwd, n_microbatches, p2p) * (1 - 1e-12)
    assert simulated >= (sum(fwd) + sum(bwd) + 2 * (len(fwd) - 1) * p2p) * (1 - 1e-12)  # micro-batch 0's chain


@settings(max_examples=100, deadline=None)
@given(stages(max_stages=8))
def test_1f1b_never_slower_than_gpipe_without_p2p(case):
    fwd, bwd, n_microbatches = case
    one_f_one_b = simulate(fwd, bwd, n_microbatches, "1f1b").step_time
    assert one_f_one_b <= simulate(fwd, bwd, n_microbatches, "gpipe").step_time * (1 + 1e-12) + 1e-12


def test_1f1b_heterogeneous_falls_on_both_sides_of_the_closed_form():
    # Heavy first stage, near-free second: stage 0 never idles, so the step is M (f_0 + b_0) = 16; the closed form
    # also counts the second stage's f + b once (16.2).
    assert simulate([2, 0.125], [2, 0.125], 4, "1f1b").step_time == 16.0
    assert step_time([2, 0.125], [2, 0.125], 4, "1f1b") == 16.25
    # Forward and backward bottlenecks on different stages: stage 2's second warm-up forward waits for stage 1's
    # forward, which the closed form's per-stage f + b does not see (5 against 4).
    fwd, bwd = [0, 1, 0, 0], [1, 0, 1, 0]
    assert simulate(fwd, bwd, 2, "1f1b").step_time == 5.0
    assert step_time(fwd, bwd, 2, "1f1b") == 4.0


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("n_microbatches", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize(("f", "b", "p2p"), [(1.0, 1.0, 0.25), (1.0, 2.0, 1.0), (2.0, 1.0, 10.0), (0.5, 3.0, 0.75)])
def test_1f1b_equal_stages_pay_steady_state_hops(n_stages, n_microbatches, f, b, p2p):
    closed = step_time([f] * n_stages, [b] * n_stages, n_microbatches, "1f1b", p2p)
    stalls = 2 * p2p * ((n_microbatches - 1) * (n_stages - 1) // n_stages)
    simulated = simulate([f] * n_stages, [b] * n_stages, n_microbatches, "1f1b", p2p).step_time
    assert simulated == pytest.approx(closed + stalls, rel=1e-12)
    assert simulated >= closed


def test_random_1f1b_deviation_from_closed_form_is_bounded():
    # A fixed random sample, to document the spread (and catch a change in it): heterogeneous stages, no p2p.
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(300):
        n_stages, n_microbatches = int(rng.integers(2, 7)), int(rng.integers(1, 10))
        fwd, bwd = rng.integers(1, 8, n_stages).astype(float), rng.integers(1, 8, n_stages).astype(float)
        ratios.append(simulate(fwd, bwd, n_microbatches).step_time / step_time(fwd, bwd, n_microbatches))
    assert 0.75 < min(ratios) < 1.0 < max(ratios) < 1.15
