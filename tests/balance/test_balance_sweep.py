"""diffuse(mode="sweep"): one scan and one flood between neighbours, within one layer's cost of brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.brute import brute_force, started

from dynmo_lightning.balance import BalancePolicy, bottleneck, diffuse, partition
from dynmo_lightning.balance.diffusion.driver import Card, DiffusionStage, drive, stage_layers, start_stages
from dynmo_lightning.balance.diffusion.sweep_mode import SLOTS, final_cuts, flood_rounds, sweep_rounds, sweep_split

PROPERTY = settings(max_examples=300, deadline=None)


#: Layer costs, some far above S / P (they leave equal shares empty and move cuts).
SPIKY = st.one_of(st.integers(0, 40), st.integers(100, 1000))


@PROPERTY
@given(started(SPIKY))
def test_sweep_ends_within_one_layer_of_brute_force(problem):
    costs, start = problem
    result = diffuse(costs, start, mode="sweep")
    best, _ = brute_force(costs, len(start))
    assert result.converged and min(result.layers_per_stage) >= 1 and sum(result.layers_per_stage) == len(costs)
    # The proven bound: bottleneck < S / P + c_max <= B* + c_max (all zero: both zero).
    assert result.bottleneck < sum(costs) / len(start) + max(costs) or max(costs) == 0
    assert result.bottleneck - best < max(costs) or result.bottleneck == best == 0
    # The stages computed, between neighbours, exactly the centralised form of the cut (integer costs: no rounding).
    assert result.layers_per_stage == sweep_split(costs, len(start))
    # Rounds: scan plus one flood, or two when huge layers moved a cut; no bound search.
    assert result.probes == 0
    assert result.rounds in (sweep_rounds(len(start), moved=False), sweep_rounds(len(start), moved=True))


@PROPERTY
@given(started(st.floats(0, 1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False)))
def test_float_costs_stay_within_the_bound_up_to_rounding(problem):
    costs, start = problem
    result = diffuse(costs, start, mode="sweep")
    best = bottleneck(costs, partition(costs, len(start)))
    assert result.bottleneck <= best + max(costs) + 1e-9 * (1 + sum(costs))


def test_huge_layers_move_cuts_and_still_leave_every_stage_a_layer():
    # Three layers each above S / P: raw equal shares leave stages empty; the final cuts give each stage one.
    costs, start = [300, 300, 300, 1, 1, 1], [2, 2, 1, 1]
    result = diffuse(costs, start, mode="sweep")
    assert result.layers_per_stage == [1, 1, 1, 3] == partition(costs, 4)
    assert result.rounds == sweep_rounds(4, moved=True)
    assert final_cuts([1, 1, 1], 6) == [1, 2, 3]  # pushed right one layer per stage
    assert final_cuts([6, 6, 6], 6) == [3, 4, 5]  # no cut leaves fewer layers than stages after it


@PROPERTY
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))), st.data())
def test_final_cuts_give_every_stage_a_layer_inside_its_equal_share_or_alone(shape, data):
    n_layers, n_stages = shape
    raw = sorted(data.draw(st.lists(st.integers(0, n_layers), min_size=n_stages - 1, max_size=n_stages - 1)))
    cuts = final_cuts(raw, n_layers)
    bounds, shares = [0, *cuts, n_layers], [0, *raw, n_layers]
    assert all(a < b for a, b in itertools.pairwise(bounds))  # every stage holds a layer
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        assert b - a == 1 or shares[s] <= a < b <= shares[s + 1]  # the lemma of the proof


def test_rounds_at_scale_are_a_scan_and_a_flood():
    rng = random.Random(0)
    costs = [float(rng.randint(300, 1000) // (3 if i < 250 else 1)) for i in range(1000)]
    start = [16] * 40 + [15] * 24
    result = diffuse(costs, start, mode="sweep")
    assert result.rounds == sweep_rounds(64, moved=False) == 63 + flood_rounds(64) < 2 * 64 + 2 * 64 // SLOTS
    best = bottleneck(costs, partition(costs, 64))
    assert best <= result.bottleneck < best + max(costs)
    assert result.rounds == 63 + 62 + 8 == 133  # the exact mode's bound search takes 5,407 here


def test_outcome_sums_match_the_split():
    costs, extra = [1, 5, 6, 4, 4, 2, 9], [10, 50, 60, 40, 40, 20, 90]
    start = [1, 1, 3, 2]
    stages = start_stages(stage_layers(costs, start, extras=[extra]), mode="sweep")
    for _ in drive(stages):
        pass
    outcome = stages[0].outcome
    assert outcome is not None and all(s.outcome == outcome for s in stages)
    sizes = [o.size for o in outcome]
    assert sizes == sweep_split(costs, 4) and [s.size for s in stages] == sizes
    ends, old_ends = list(itertools.accumulate(sizes)), list(itertools.accumulate(start))
    for s, o in enumerate(outcome):
        new = range(ends[s] - sizes[s], ends[s])
        held = range(old_ends[s] - start[s], old_ends[s])
        assert o.new == (sum(costs[i] for i in new), 0.0, sum(extra[i] for i in new))
        assert o.old == (sum(costs[i] for i in held), 0.0, sum(extra[i] for i in held))
        assert o.received[0] == sum(costs[i] for i in new if i not in held)


def test_cards_with_lanes_round_trip():
    stage = DiffusionStage(1, 4, 2, [(3.0, 0.0, 1.0), (4.0, 0.0, 2.0)], n_layers=8, mode="sweep")
    assert stage.slots == SLOTS
    card = Card(1.0, 2.0, 2, 4, False, False, 0, (3.0, 0.0, 1.0), (4.0, 0.0, 2.0), (0, 0, 0),
                to_right=((2.0, 4.0, 1.0, 0.0, 7.0, 0.0, 3.0),), to_left=())  # fmt: skip
    flat = card.encode(SLOTS)
    assert len(flat) == stage.card_floats
    back = Card.decode(flat, 3, SLOTS)
    assert back.to_left == () and back.to_right[0][:7] == card.to_right[0]
    crowded = dataclasses.replace(card, to_left=card.to_right * 2)
    with pytest.raises(ValueError, match="a lane of 2 entries does not fit a card of 1 slots"):
        crowded.encode(1)
    with pytest.raises(ValueError, match="diffusion mode 'fast' is not one of"):
        DiffusionStage(0, 2, 0, [(1.0, 0.0)], n_layers=2, mode="fast")


def test_policy_plans_in_the_configured_mode():
    with pytest.raises(ValueError, match=r"balancer.diffusion_mode='fast' is not one of"):
        BalancePolicy("diffusion", diffusion_mode="fast")
    assert BalancePolicy("diffusion").settings.diffusion_mode == "exact"  # the default: the optimal split
