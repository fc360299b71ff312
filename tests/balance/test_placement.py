"""Stage-to-rank placement: loops and Vs."""

import pytest

from dynmo_lightning.balance.split.placement import rank_stages, stage_ranks


def test_looped_schedules_place_stage_s_on_rank_s_mod_r():
    assert stage_ranks("1f1b", 4) == [0, 1, 2, 3]
    assert stage_ranks("interleaved_1f1b", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert rank_stages("interleaved_zb", 2, 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_pair_stage_s_with_stage_2r_minus_1_minus_s(schedule):
    assert stage_ranks(schedule, 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages(schedule, 2, 2) == [[0, 3], [1, 2]]


@pytest.mark.parametrize(("args", "match"), [(("zbv", 2, 1), "stages_per_rank=2"), (("1f1b", 0), "n_ranks"),
                                             (("1f1b", 2, 0), "stages_per_rank")])  # fmt: skip
def test_bad_sizes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        stage_ranks(*args)
