"""validate_partition, stage_loads and bottleneck."""

from __future__ import annotations

import numpy as np
import pytest

from dynmo_lightning.balance import bottleneck, stage_loads, validate_partition


def test_valid_partition_comes_back_as_plain_ints():
    out = validate_partition([np.int64(3), 2, 3], 8, 3)
    assert out == [3, 2, 3]
    assert all(type(size) is int for size in out)


@pytest.mark.parametrize(
    ("sizes", "n_layers", "n_stages", "match"),
    [
        (
            [3, 4],
            8,
            None,
            r"^partition \[3, 4\] sums to 7 but the model has 8 layers; give one entry per stage summing to 8$",
        ),
        ([3, 0, 5], 8, None, r"partition \[3, 0, 5\] gives stage 1 0 layers; every stage needs at least one layer"),
        ([4, 4], 8, 3, r"partition \[4, 4\] has 2 stages but there are 3; give one entry per stage"),
        ([4, 1.5, 2.5], 8, None, r"has 1.5 for stage 1: entries must be integer layer counts"),
        ([4, "4"], 8, None, r"has '4' for stage 1: entries must be integer layer counts"),
        ([7, True], 8, None, r"has True for stage 1: entries must be integer layer counts"),
    ],
)
def test_invalid_partitions_name_the_problem(sizes, n_layers, n_stages, match):
    with pytest.raises(ValueError, match=match):
        validate_partition(sizes, n_layers, n_stages)


def test_stage_loads_and_bottleneck():
    costs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert stage_loads(costs, [2, 2, 1]) == [3.0, 7.0, 5.0]
    assert bottleneck(costs, [2, 2, 1]) == 7.0
    assert bottleneck(costs, [5]) == 15.0


def test_loads_check_their_arguments():
    with pytest.raises(ValueError, match="sums to 4 but the model has 5 layers"):
        stage_loads([1, 2, 3, 4, 5], [2, 2])
    with pytest.raises(ValueError, match=r"costs\[0\] = -1.0"):
        bottleneck([-1, 2], [1, 1])
