"""partition(): exactness against brute force, every method's contract, and error messages."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.brute import blocks, brute_force, compositions

from dynmo_lightning.balance import METHODS, InfeasibleMemoryError, bottleneck, partition

PROPERTY = settings(max_examples=200, deadline=None)


@st.composite
def problems(draw, elements):
    n_layers = draw(st.integers(1, 12))
    n_stages = draw(st.integers(1, min(n_layers, 5)))
    return draw(st.lists(elements, min_size=n_layers, max_size=n_layers)), n_stages


def assert_valid(sizes, n_layers, n_stages):
    assert len(sizes) == n_stages
    assert all(isinstance(s, int) and s >= 1 for s in sizes)
    assert sum(sizes) == n_layers


@PROPERTY
@given(problems(st.integers(0, 50)))
def test_optimal_equals_brute_force_on_integer_costs(problem):
    costs, n_stages = problem
    sizes = partition(costs, n_stages)
    assert_valid(sizes, len(costs), n_stages)
    best, optimal_splits = brute_force(costs, n_stages)
    assert max(sum(b) for b in blocks(costs, sizes)) == best
    assert bottleneck(costs, sizes) == best
    # Documented tie-break: the lexicographically largest optimal split.
    assert sizes == max(optimal_splits)


@PROPERTY
@given(problems(st.floats(0, 1e3, allow_nan=False, allow_infinity=False, allow_subnormal=False)))
def test_optimal_equals_brute_force_on_float_costs(problem):
    costs, n_stages = problem
    sizes = partition(costs, n_stages)
    assert_valid(sizes, len(costs), n_stages)
    best, _ = brute_force(costs, n_stages)
    assert math.isclose(max(sum(b) for b in blocks(costs, sizes)), best, rel_tol=1e-9, abs_tol=1e-12)
    # In the planner's own arithmetic (prefix sums) no split beats it at all.
    assert bottleneck(costs, sizes) <= min(bottleneck(costs, s) for s in compositions(len(costs), n_stages))


@st.composite
def memory_problems(draw):
    costs, n_stages = draw(problems(st.integers(0, 30)))
    memory = draw(st.lists(st.integers(0, 10), min_size=len(costs), max_size=len(costs)))
    per_stage = st.lists(st.integers(0, 30), min_size=n_stages, max_size=n_stages)
    capacity = draw(st.one_of(st.integers(0, 30), per_stage))
    return costs, n_stages, memory, capacity


@PROPERTY
@given(memory_problems())
def test_optimal_with_memory_caps_equals_brute_force(problem):
    costs, n_stages, memory, capacity = problem
    best, optimal_splits = brute_force(costs, n_stages, memory, capacity)
    if best is None:
        with pytest.raises(InfeasibleMemoryError):
            partition(costs, n_stages, memory=memory, capacity=capacity)
        return
    sizes = partition(costs, n_stages, memory=memory, capacity=capacity)
    assert_valid(sizes, len(costs), n_stages)
    caps = capacity if isinstance(capacity, list) else [capacity] * n_stages
    assert all(sum(m) <= cap for m, cap in zip(blocks(memory, sizes), caps, strict=True))
    assert bottleneck(costs, sizes) == best
    assert sizes == max(optimal_splits)


def test_per_stage_capacity_needs_more_than_a_greedy():
    # A left-to-right greedy puts layers 0-3 on stage 0 and leaves the small stage 1 nothing it can hold alone;
    # the only feasible split gives stage 1 exactly layer 1.
    assert partition([1, 1, 1, 1], 3, memory=[1, 1, 5, 1], capacity=[10, 1, 10]) == [1, 1, 2]


@PROPERTY
@given(problems(st.integers(0, 20)), st.sampled_from(METHODS))
def test_every_method_returns_a_valid_partition(problem, method):
    costs, n_stages = problem
    assert_valid(partition(costs, n_stages, method=method), len(costs), n_stages)


@pytest.mark.parametrize(
    ("n_layers", "n_stages", "expected"),
    [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (5, 5, [1, 1, 1, 1, 1]), (7, 1, [7]), (13, 5, [3, 3, 3, 2, 2])],
)
def test_uniform_splits_by_count_larger_stages_first(n_layers, n_stages, expected):
    costs = list(range(n_layers))  # ignored except for their number
    assert partition(costs, n_stages, method="uniform") == expected


def test_uniform_ignores_memory_limits():
    assert partition([1.0] * 4, 2, method="uniform", memory=[9, 9, 1, 1], capacity=10) == [2, 2]


def test_params_balances_parameter_counts_exactly():
    # Embedding, 6 equal blocks, large head.
    counts = [50_000, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000, 60_000]
    sizes = partition(counts, 3, method="params")
    assert sizes == [2, 5, 1]
    assert bottleneck(counts, sizes) == 60_000


def test_static_time_is_the_optimal_split_of_profiled_times():
    times = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    assert partition(times, 3, method="static_time") == partition(times, 3) == [1, 4, 1]


def test_diffusion_method_matches_optimal():
    costs = [5, 1, 1, 1, 9, 2, 2, 7, 3, 3]
    assert partition(costs, 4, method="diffusion") == partition(costs, 4)


def test_accepts_numpy_and_zero_costs():
    assert partition(np.zeros(6), 3) == [4, 1, 1]
    assert partition(np.array([1, 2, 3]), 3) == [1, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "greedy"}, "unknown partition method 'greedy'; valid methods: optimal, uniform, params, "),
        ({"n_stages": 0}, r"n_stages=0 but a pipeline needs at least one stage"),
        (
            {"n_stages": 5},
            r"^n_stages=5 > 4 layers: every stage needs at least one layer; use fewer stages or a model with more "
            r"layers$",
        ),
        ({"n_stages": 2.5}, "n_stages must be an integer"),
        ({"costs": [1.0, -1.0, 1.0, 1.0]}, r"costs\[1\] = -1.0 is not allowed: every entry of costs must be finite"),
        ({"costs": [1.0, math.nan, 1.0, 1.0]}, r"costs\[1\] = nan"),
        ({"costs": [1.0, 1.0, math.inf, 1.0]}, r"costs\[2\] = inf"),
        ({"costs": [1e308, 1e308, 1.0, 1.0]}, "costs sum to infinity"),
        ({"memory": [1, 1, 1], "capacity": 5}, "memory has 3 entries but costs has 4"),
        ({"memory": [1, 1, 1, 1]}, "memory was given without capacity"),
        ({"capacity": 4.0}, "capacity was given without memory"),
        ({"memory": [1, 1, 1, 1], "capacity": [4, 4, 4]}, "capacity has 3 entries but there are 2 stages"),
        ({"memory": [1, -1, 1, 1], "capacity": 4}, r"memory\[1\] = -1.0"),
        ({"memory": [1, 1, 1, 1], "capacity": -4}, "capacity of stage 0 is -4.0"),
    ],
)
def test_invalid_arguments_raise_value_error(kwargs, match):
    args = {"costs": [1.0, 2.0, 3.0, 4.0], "n_stages": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        partition(args.pop("costs"), args.pop("n_stages"), **args)


@pytest.mark.parametrize(
    ("memory", "capacity", "n_stages", "match"),
    [
        ([1, 1, 12, 1], 10.0, 2, r"a single layer 2 needs 12 > capacity 10 of any stage"),
        ([1, 1, 12, 1], [10, 11], 2, r"a single layer 2 needs 12 > capacity 11 of any stage"),
        (
            [4, 4, 4, 4, 4],
            10.0,
            2,
            r"filling stages 0..1 in turn .* covers layers 0..3 only; layers 4..4 still need 4 "
            r"\(total memory 20 vs total capacity 20\)",
        ),
        (
            [1, 5, 1],
            [10, 1, 10],
            3,
            r"stage 1 \(capacity 1\) can only end where stages 2..2 can start.*layer 1, needs 5",
        ),
        ([1, 1, 5], [10, 10, 1], 3, r"stage 2 \(capacity 1\) can only end at the last layer.*layer 2, needs 5"),
        ([2, 2, 1, 1], [3, 1, 10], 3, r"stage 0 \(capacity 3\) would need 4 for layers 0..1"),
    ],
)
def test_infeasible_memory_names_the_reason(memory, capacity, n_stages, match):
    with pytest.raises(InfeasibleMemoryError, match=match) as info:
        partition([1.0] * len(memory), n_stages, memory=memory, capacity=capacity)
    assert isinstance(info.value, ValueError)
