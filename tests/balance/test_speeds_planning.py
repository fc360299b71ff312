"""Planning with per-process speeds (issue 47) against brute force: the bottleneck split, 1F1B and the V schedules.

A rank of speed ``v`` runs every task of its stages in ``1 / v`` of the time measured at the reference speed; the
planners get the speeds and must still find the optimum every split reaches, timed independently
(:func:`~dynmo_lightning.sim.simulate` on the per-stage times divided by the speeds by hand).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.brute import block_sums, compositions

from dynmo_lightning.balance import partition
from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.planner import TOLERANCE, StepModel, makespan_split
from dynmo_lightning.sim import simulate

pytestmark = pytest.mark.timeout(300)  # a bound search that never settles hangs; it must fail instead

SPEEDS = st.sampled_from([0.5, 0.7, 0.9, 1.0, 1.0, 0.25, 1.3])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_bottleneck_split_with_speeds_equals_brute_force(data):
    n_layers = data.draw(st.integers(1, 9))
    n_stages = data.draw(st.integers(1, n_layers))
    costs = data.draw(st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=n_layers, max_size=n_layers))
    speeds = data.draw(st.lists(SPEEDS, min_size=n_stages, max_size=n_stages))
    memory = data.draw(st.none() | st.lists(st.floats(0.0, 2.0), min_size=n_layers, max_size=n_layers))
    capacity = data.draw(st.floats(1.0, 6.0)) if memory is not None else None

    def worst(split):
        return max(t / v for t, v in zip(block_sums(costs, split), speeds, strict=True))

    feasible = [s for s in compositions(n_layers, n_stages)
                if memory is None or all(b <= capacity for b in block_sums(memory, s))]  # fmt: skip
    if not feasible:
        with pytest.raises(ValueError):
            partition(costs, n_stages, speeds=speeds, memory=memory, capacity=capacity)
        return
    split = partition(costs, n_stages, speeds=speeds, memory=memory, capacity=capacity)
    assert split in feasible
    assert worst(split) == min(worst(s) for s in feasible)


def test_a_slow_stage_gets_fewer_layers():
    assert partition([1.0] * 8, 2) == [4, 4]
    assert partition([1.0] * 9, 2, speeds=[1.0, 0.5]) == [6, 3]  # 6 and 3 / 0.5: both stages take 6
    assert partition([1.0] * 9, 3, speeds=[0.5, 1.0, 1.0]) == [2, 4, 3]
    with pytest.raises(ValueError, match="one speed per stage"):
        partition([1.0] * 4, 2, speeds=[1.0])
    with pytest.raises(ValueError, match=r"speed of stage 1 is 0\.0"):
        partition([1.0] * 4, 2, speeds=[1.0, 0.0])
    with pytest.raises(ValueError, match="diffusion"):
        partition([1.0] * 4, 2, speeds=[1.0, 0.5], method="diffusion")


#: (schedule, stages per rank): 1F1B and GPipe, and the V and loop schedules of two stages per rank.
PLACEMENTS = [("1f1b", 1), ("gpipe", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 2)]


@st.composite
def problems(draw):
    schedule, spr = draw(st.sampled_from(PLACEMENTS))
    n_ranks = draw(st.integers(1, 3))
    n_stages = n_ranks * spr
    n_layers = draw(st.integers(n_stages, min(n_stages + 5, 10)))
    m = draw(st.integers(1, 4))
    if schedule in ("interleaved_1f1b", "dualpipev"):
        m = max(2 if schedule == "dualpipev" else 1, m) * n_ranks
    times = st.floats(0.05, 3.0, allow_nan=False, allow_infinity=False)
    fwd = draw(st.lists(times, min_size=n_layers, max_size=n_layers))
    bwd = [2 * f * draw(st.floats(0.5, 1.5)) for f in fwd]
    wgt = [b * draw(st.floats(0.0, 0.6)) for b in bwd]
    p2p = draw(st.sampled_from([0.0, 0.05, 0.3]))
    speeds = draw(st.lists(SPEEDS, min_size=n_ranks, max_size=n_ranks))
    memory = draw(st.none() | st.lists(st.floats(0.0, 2.0), min_size=n_layers, max_size=n_layers))
    return schedule, spr, n_stages, m, fwd, bwd, wgt, p2p, speeds, memory


def by_hand(split, fwd, bwd, wgt, m, schedule, p2p, spr, speeds):
    """The step time of ``split`` with each stage's sums divided by its rank's speed, by the simulator."""
    ranks = stage_ranks(schedule, len(split) // spr, spr)
    rate = [speeds[r] for r in ranks]
    ends = np.cumsum(split)
    sums = [[sum(v[e - n : e]) / rate[k] for k, (e, n) in enumerate(zip(ends, split, strict=True))]
            for v in (fwd, bwd, wgt)]  # fmt: skip
    return simulate(sums[0], sums[1], m, schedule, p2p, stage_wgt=sums[2], stages_per_rank=spr).step_time


@settings(max_examples=150, deadline=None)
@given(problems(), st.floats(1.0, 6.0))
def test_makespan_split_with_speeds_equals_brute_force(problem, capacity):
    schedule, spr, n_stages, m, fwd, bwd, wgt, p2p, speeds, memory = problem
    model = StepModel(fwd, bwd, m, schedule, p2p, wgt=wgt, stages_per_rank=spr, speeds=speeds)
    feasible = [s for s in compositions(len(fwd), n_stages)
                if memory is None or all(b <= capacity for b in block_sums(memory, s))]  # fmt: skip
    found = makespan_split(model, n_stages, memory=memory, capacity=capacity if memory is not None else None)
    if not feasible:
        assert found is None
        return
    timed = {tuple(s): by_hand(s, fwd, bwd, wgt, m, schedule, p2p, spr, speeds) for s in feasible}
    best = min(timed.values())
    assert found is not None
    t, split = found
    assert tuple(split) in timed and math.isclose(t, timed[tuple(split)], rel_tol=1e-9, abs_tol=1e-12)
    assert best <= t * (1 + 1e-9) and t <= best * (1 + TOLERANCE) + 1e-9


def test_speeds_must_match_the_ranks_planned():
    model = StepModel([1.0] * 4, [2.0] * 4, 4, speeds=[1.0, 0.5])
    assert model([2, 2]) > model.with_speeds(None)([2, 2])
    with pytest.raises(ValueError, match="one speed per rank"):
        model([1, 1, 2])
    with pytest.raises(ValueError, match="finite and > 0"):
        StepModel([1.0], [1.0], 1, speeds=[-1.0])
    assert model.with_speeds([1.0, 1.0]).speeds is None  # all at the reference: the plain model
