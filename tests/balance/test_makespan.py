"""The step-time model: torch 2.13's task orders, the event engine, and where the closed form is exact."""

from __future__ import annotations

import random

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from dynmo_lightning.balance import stage_times, step_time
from dynmo_lightning.balance.split.placement import stage_ranks
from dynmo_lightning.balance.steptime.makespan import SCHEDULES, lower_bound, makespan, rank_orders, timeline

_CLASSES = {
    "gpipe": torch_schedules.ScheduleGPipe,
    "1f1b": torch_schedules.Schedule1F1B,
    "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "interleaved_zb": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}


def _torch_order(schedule: str, n_ranks: int, n_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Torch's own ``pipeline_order`` (compute tasks only, overlapped pairs in their order), without a process group.

    The schedule object is made without ``__init__`` (which needs stages and a group) and given the attributes its
    order methods read.
    """
    obj = object.__new__(_CLASSES[schedule])
    obj._n_microbatches = n_microbatches
    if schedule in ("gpipe", "1f1b"):
        obj._num_stages = n_ranks
        order = obj._get_pipeline_order()
    else:
        obj.pp_group_size, obj.n_local_stages = n_ranks, 2
        obj.num_stages = obj._num_stages = 2 * n_ranks
        obj.number_of_rounds = max(1, n_microbatches // n_ranks)
        obj.microbatches_per_round = n_microbatches // obj.number_of_rounds
        order = {r: obj._calculate_single_rank_operations(r) for r in range(n_ranks)}
        if schedule == "interleaved_zb":
            obj.pipeline_order = order
            order = obj._add_bubbles_to_actions(2 * n_ranks)  # only adds idle slots
    out = []
    for r in range(n_ranks):
        tasks = []
        for action in order[r]:
            if action is None:
                continue
            for a in action.sub_actions or (action,):
                if a.computation_type.value in ("F", "B", "I", "W"):
                    tasks.append((a.computation_type.value, a.stage_index, a.microbatch_index))
        out.append(tasks)
    return out


def _sizes(schedule: str):
    for n_ranks in range(1, 5):
        for m in range(1, 11):
            if schedule in ("gpipe", "1f1b") and m < n_ranks:
                continue  # torch's pipeline_order (not its runtime) assumes M >= P
            if schedule == "dualpipev" and m < 2 * n_ranks:
                continue  # torch refuses it
            if schedule.startswith("interleaved") and m % max(1, m // n_ranks):
                continue  # torch refuses it
            yield n_ranks, m


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "1f1b"])
def test_task_orders_equal_torchs_pipeline_order(schedule):
    stages_per_rank = 1 if schedule == "gpipe" else 2
    for n_ranks, m in _sizes(schedule):
        assert rank_orders(schedule, n_ranks, m, stages_per_rank) == _torch_order(schedule, n_ranks, m), (n_ranks, m)


def test_1f1b_order_equals_torchs_runtime_order():
    # Schedule1F1B runs its own loop (min(M, P - s) warm-up forwards, then 1B1F); its pipeline_order matches it on
    # every rank but the last, where its forward counter starts one ahead (it starts at 1 when no warm-up precedes).
    for n_ranks, m in _sizes("1f1b"):
        ours, theirs = rank_orders("1f1b", n_ranks, m), _torch_order("1f1b", n_ranks, m)
        assert ours[:-1] == theirs[:-1]
        assert ours[-1] == [(k, s, i - 1 if k == "F" else i) for k, s, i in theirs[-1]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_task_runs_once_and_never_deadlocks(schedule):
    spr = 1 if schedule in ("gpipe", "1f1b") else 2
    rng = random.Random(0)
    for n_ranks, m in _sizes(schedule):
        n = n_ranks * spr
        fwd = [rng.uniform(0.1, 2) for _ in range(n)]
        bwd = [2 * f for f in fwd]
        t, tasks = timeline(
            fwd, bwd, m, schedule, 0.1, stage_wgt=[b / 3 for b in bwd], stages_per_rank=spr, record=True
        )
        kinds = {"F", "B"} if schedule in ("gpipe", "1f1b", "interleaved_1f1b") else {"F", "I", "W", "B"}
        assert {x.kind for x in tasks} <= kinds
        assert len({(x.kind, x.stage, x.microbatch) for x in tasks}) == len(tasks)
        assert sum(x.kind == "F" for x in tasks) == n * m
        assert t == max(x.end for x in tasks)
        ranks = stage_ranks(schedule, n_ranks, spr)
        assert t >= lower_bound(fwd, bwd, m, ranks) - 1e-9


def test_closed_form_is_exact_for_gpipe_and_equal_1f1b_stages_only():
    rng = random.Random(1)
    for _ in range(50):
        n, m = rng.randint(1, 6), rng.randint(1, 8)
        fwd, bwd, p2p = [rng.random() for _ in range(n)], [rng.random() for _ in range(n)], rng.random()
        assert makespan(fwd, bwd, m, "gpipe", p2p) == pytest.approx(step_time(fwd, bwd, m, "gpipe", p2p))
        assert makespan([0.5] * n, [1.0] * n, m, "1f1b") == pytest.approx(step_time([0.5] * n, [1.0] * n, m))
    # Unequal 1F1B stages at few micro-batches: a heavy first stage hides in the others' fill.
    assert makespan([2.0, 1.0], [4.0, 2.0], 4) < step_time([2.0, 1.0], [4.0, 2.0], 4)


def test_v_placement_turns_around_without_a_hop():
    # ZBV: stages 1 and 2 share rank 1 (of 2), so only the hops 0->1 and 2->3 (and back) cost p2p.
    assert stage_ranks("zbv", 2, 2) == [0, 1, 1, 0]
    free, hops = makespan([1.0] * 4, [2.0] * 4, 4, "zbv", 0.0, stages_per_rank=2), 0.25
    assert makespan([1.0] * 4, [2.0] * 4, 4, "zbv", hops, stages_per_rank=2) > free


def test_zero_bubble_fills_the_drain_with_weight_gradients():
    fwd, bwd = [1.0] * 4, [2.0] * 4
    plain = makespan(fwd, bwd, 8, "interleaved_1f1b", stages_per_rank=2)
    split = makespan(fwd, bwd, 8, "interleaved_zb", stage_wgt=[1.0] * 4, stages_per_rank=2)
    assert split < plain


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        makespan([1.0], [1.0], 2, "zero-bubble")
    with pytest.raises(ValueError, match="two stages per rank"):
        makespan([1.0, 1.0], [1.0, 1.0], 2, "zbv")
    with pytest.raises(ValueError, match="cannot exceed"):
        makespan([1.0], [1.0], 2, stage_wgt=[2.0])
    with pytest.raises(ValueError, match="dualpipev needs"):
        rank_orders("dualpipev", 2, 3, 2)


def test_simulator_and_policy_share_the_engine():
    from dynmo_lightning.sim import simulate_layers

    fwd, bwd = [1.0, 2.0, 1.0, 3.0], [2.0, 4.0, 2.0, 6.0]
    for schedule, spr in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)):
        split = [1, 1, 1, 1] if spr == 2 else [2, 2]
        sim = simulate_layers(fwd, bwd, split, 4, schedule, 0.1, stages_per_rank=spr).step_time
        assert sim == makespan(*stage_times(fwd, bwd, split), 4, schedule, 0.1, stages_per_rank=spr)
