"""diffuse(): neighbour-only rounds that end on the optimal split."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.brute import started

from dynmo_lightning.balance import InfeasibleMemoryError, bottleneck, diffuse, partition
from dynmo_lightning.balance.diffusion.driver import (
    Card,
    card_width,
    diffusion_rounds,
    drive,
    probe_bound,
    require_outcome_fits,
    round_bound,
    stage_layers,
    start_stages,
)
from dynmo_lightning.balance.diffusion.sweep_mode import sweep_split

PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(started(st.integers(0, 40)))
def test_ends_on_the_optimal_split_from_any_start(problem):
    costs, start = problem
    result = diffuse(costs, start, max_rounds=100_000)
    assert result.converged
    assert result.layers_per_stage == partition(costs, len(start))
    assert result.bottleneck == bottleneck(costs, partition(costs, len(start)))
    # Two or more stages at least all-reduce their starting facts and settle once.
    assert result.rounds == 0 if len(start) == 1 else result.rounds >= 3 * len(start) - 1


@PROPERTY
@given(started(st.floats(0, 1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False)))
def test_float_costs_reach_the_optimal_bottleneck(problem):
    costs, start = problem
    result = diffuse(costs, start)
    assert result.converged
    best = bottleneck(costs, partition(costs, len(start)))
    assert math.isclose(result.bottleneck, best, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("mode", ["exact", "sweep"])
@PROPERTY
@given(started(st.integers(0, 30)), st.data())
def test_respects_a_shared_memory_capacity(mode, problem, data):
    costs, start = problem
    memory = data.draw(st.lists(st.integers(0, 10), min_size=len(costs), max_size=len(costs)))
    capacity = data.draw(st.integers(0, 40))
    try:
        expected = partition(costs, len(start), memory=memory, capacity=capacity)
    except InfeasibleMemoryError:
        with pytest.raises(InfeasibleMemoryError):
            diffuse(costs, start, memory=memory, capacity=capacity, mode=mode)
        return
    result = diffuse(costs, start, memory=memory, capacity=[capacity] * len(start), mode=mode)
    assert result.converged
    swept = sweep_split(costs, len(start))
    ends = [0, *itertools.accumulate(swept)]
    if mode == "sweep" and all(sum(memory[a:b]) <= capacity for a, b in itertools.pairwise(ends)):
        assert result.layers_per_stage == swept and result.probes == 0
    else:  # exact; or the sweep's equal-share split broke the capacity, every stage saw it and went on in exact mode
        assert result.layers_per_stage == expected


def test_a_final_cut_through_a_run_of_layers_is_flooded_again():
    """Found by hypothesis: layers of no cost share their equal share with the next, so a final cut went through a
    run of layers; its memory counted on one stage (a false breach, and a needless fall-back to the exact mode)."""
    result = diffuse([0, 0, 1, 1], [1, 2, 1], memory=[0, 1, 1, 0], capacity=[1] * 3, mode="sweep")
    assert result.layers_per_stage == [2, 1, 1] and result.probes == 0


@settings(max_examples=100, deadline=None)
@given(started(st.integers(0, 40)))
def test_rounds_move_layers_only_between_neighbours(problem):
    costs, start = problem
    previous = list(itertools.accumulate(start))
    for expected_index, snapshot in enumerate(diffusion_rounds(costs, start), start=1):
        assert snapshot.index == expected_index
        ends = list(itertools.accumulate(snapshot.layers_per_stage))
        assert min(snapshot.layers_per_stage) >= 1
        assert ends[-1] == len(costs)
        for boundary, (before, after) in enumerate(zip(previous[:-1], ends[:-1], strict=True)):
            # One layer per boundary per round, and only on the boundaries whose turn it is: no stage gains or
            # loses on both sides at once, so no layer skips a stage.
            assert abs(after - before) <= 1
            if after != before:
                assert boundary % 2 == snapshot.index % 2
                assert snapshot.phase == ("push" if after < before else "pull")
        previous = ends


def test_relays_layers_through_one_layer_stages():
    # Stage 0 wants layer 1, but stage 1 holds only that layer: stage 1 first takes layer 2 from stage 2 (even
    # above the bound), then hands layer 1 on.
    costs, start = [1, 5, 6, 4, 4], [1, 1, 3]
    pulls = [r.layers_per_stage for r in diffusion_rounds(costs, start) if r.phase == "pull"]
    assert pulls[:3] == [(1, 1, 3), (1, 2, 2), (2, 1, 2)]
    result = diffuse(costs, start)
    assert result.layers_per_stage == partition(costs, 3) == [2, 1, 2]
    assert result.bottleneck == 8


def test_max_rounds_stops_early_with_a_valid_split():
    costs, start = [9, 1, 1, 1, 1, 1, 1, 9], [1, 1, 1, 5]
    full = diffuse(costs, start)
    assert full.converged and full.rounds > 5
    cut = diffuse(costs, start, max_rounds=5)
    assert not cut.converged
    assert cut.rounds == 5
    assert sum(cut.layers_per_stage) == len(costs) and min(cut.layers_per_stage) >= 1
    exact = diffuse(costs, start, max_rounds=full.rounds)
    assert exact.converged and exact.layers_per_stage == full.layers_per_stage
    nothing = diffuse(costs, start, max_rounds=0)
    assert nothing.layers_per_stage == start and nothing.rounds == 0 and not nothing.converged


def test_single_stage_needs_no_rounds():
    assert diffuse([3.0, 1.0], [2]) == diffuse([3.0, 1.0], [2], max_rounds=0)
    assert diffuse([3.0, 1.0], [2]).converged


def test_per_stage_capacities_are_refused():
    with pytest.raises(ValueError, match="diffusion needs one capacity shared by all stages"):
        diffuse([1, 1, 1], [1, 2], memory=[1, 1, 1], capacity=[2, 3])


def test_invalid_arguments():
    with pytest.raises(ValueError, match="sums to 3 but the model has 4 layers"):
        diffuse([1, 1, 1, 1], [1, 2])
    with pytest.raises(ValueError, match="max_rounds must be None or an integer >= 0"):
        diffuse([1, 1], [1, 1], max_rounds=-1)
    with pytest.raises(InfeasibleMemoryError, match="a single layer 0 needs 5"):
        diffuse([1, 1], [1, 1], memory=[5, 1], capacity=4)


@PROPERTY
@given(started(st.integers(0, 40)))
def test_rounds_and_probes_stay_within_the_stated_bounds(problem):
    costs, start = problem
    result = diffuse(costs, start)
    assert result.rounds <= round_bound(len(costs), len(start), result.probes)
    # Integer costs: distinct block sums differ by at least 1.
    assert result.probes <= probe_bound(bottleneck(costs, start), max(costs), 1.0)


def test_rounds_at_scale_stay_far_below_the_bound():
    rng = random.Random(0)
    costs = [rng.randint(1, 1000) for _ in range(1000)]
    start = [16] * 40 + [15] * 24
    result = diffuse(costs, start)
    assert result.layers_per_stage == partition(costs, 64)
    assert result.probes <= probe_bound(bottleneck(costs, start), max(costs), 1.0)
    assert result.rounds <= round_bound(1000, 64, result.probes)


def test_one_stage_sees_only_cards_and_the_cards_round_trip():
    stages = start_stages(stage_layers([1, 5, 6, 4, 4], [1, 1, 3], extras=[[10, 50, 60, 40, 40]]))
    card = stages[1].card
    assert card is not None
    assert Card.decode(card.encode(), stages[1].width) == card
    assert len(card.encode()) == card_width(3)
    for _ in drive(stages):
        pass
    outcome = stages[2].outcome
    assert outcome is not None and outcome == stages[0].outcome  # every stage learns the same table
    assert [o.size for o in outcome] == partition([1, 5, 6, 4, 4], 3)
    # Per-stage sums of (cost, memory, extra): what it holds, what it received, what it held.
    assert [o.new[0] for o in outcome] == [6, 6, 8]
    assert [o.received[2] for o in outcome] == [50, 60, 0]
    assert [o.old[0] for o in outcome] == [1, 5, 14]


def test_a_run_whose_split_breaks_the_capacity_is_refused():
    # 8 layers of memory 5 on 4 stages with capacity 6: no split fits, yet the stages (which cannot know it without
    # gathering every layer's memory) end their run; the outcome, known to every stage, is what is checked.
    stages = start_stages(stage_layers([1.0] * 8, [2, 2, 2, 2], [5.0] * 8), 6.0)
    for _ in drive(stages):
        pass
    outcome = stages[0].outcome
    assert outcome is not None and all(s.outcome == outcome for s in stages)
    with pytest.raises(InfeasibleMemoryError, match=r"balancer\.memory_capacity=6"):
        require_outcome_fits(outcome, 6.0)
    fitting = start_stages(stage_layers([1.0] * 8, [2, 2, 2, 2], [5.0] * 8), 10.0)
    for _ in drive(fitting):
        pass
    require_outcome_fits(fitting[0].outcome, 10.0)  # two layers per stage fit
    require_outcome_fits(outcome, None)  # no capacity, nothing to check
