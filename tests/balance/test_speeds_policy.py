"""Process speeds in the balance policy (issue 47): measured, smoothed, normalised, planned with, released first.

Speeds enter as calibration kernel times in the measurements (``probe_s`` per layer, with its ``pp_rank``), as the
runtime's profile carries them; nothing here is timed.
"""

from __future__ import annotations

import pytest

from dynmo_lightning.balance import BalancePolicy, PipelineShape
from dynmo_lightning.balance.decision.policy import REPACK
from dynmo_lightning.balance.decision.repack import plan_repack
from dynmo_lightning.balance.decision.speeds import ProcessSpeeds
from dynmo_lightning.callbacks.balancer import _naming_slow
from dynmo_lightning.pipeline.elastic.release import ReleaseEvent
from dynmo_lightning.pipeline.stage.reduce import _across_replicas
from dynmo_lightning.sim import simulate_run


def measured(costs, split, speeds):
    """One profiled step: every layer's times on its rank (cost over speed) and that rank's kernel time."""
    owner = [r for r, n in enumerate(split) for _ in range(n)]
    return {
        i: {"fwd": c / speeds[owner[i]], "bwd": 2 * c / speeds[owner[i]], "probe_s": 1e-3 / speeds[owner[i]],
            "pp_rank": float(owner[i])}
        for i, c in enumerate(costs)
    }  # fmt: skip


def test_times_are_normalised_to_the_fastest_process():
    m = measured([1.0, 1.0, 3.0], [2, 1], [1.0, 0.5])
    assert m[2]["fwd"] == 6.0  # as timed on the slow process
    norm = ProcessSpeeds.normalise(m)
    assert [v["fwd"] for v in norm.values()] == [1.0, 1.0, 3.0]
    assert norm[2]["probe_s"] == m[2]["probe_s"]  # bookkeeping stays
    plain = {0: {"fwd": 2.0, "bwd": 4.0}}
    assert ProcessSpeeds.normalise(plain) == plain  # a trace without kernel times
    assert ProcessSpeeds.probes(m) == {0: 1e-3, 1: 2e-3}


def test_one_noisy_step_moves_nothing_a_lasting_change_does():
    speeds = ProcessSpeeds(tolerance=0.1, window=3)
    assert not speeds.observe({0: 1.0, 1: 1.0})
    assert speeds.in_force == [1.0, 1.0]
    assert not speeds.observe({0: 1.0, 1: 2.0})  # one slow step among alike ones: the median stays
    assert not speeds.observe({0: 1.0, 1: 1.02})  # noise within the tolerance
    assert speeds.in_force == [1.0, 1.0]
    assert speeds.observe({0: 1.0, 1: 2.0})  # two slow of the last three: a lasting change
    assert speeds.in_force == [1.0, 0.5]


def test_a_straggler_is_followed_and_its_recovery_too():
    speeds = ProcessSpeeds(tolerance=0.1, window=3)
    for _ in range(3):
        speeds.observe({0: 1.0, 1: 1.0, 2: 1.0})
    changes = [speeds.observe({0: 1.0, 1: 1.5, 2: 1.0}) for _ in range(3)]
    assert changes.count(True) == 1 and speeds.in_force == pytest.approx([1.0, 1 / 1.5, 1.0])
    assert speeds.planning(3) == pytest.approx([1.0, 1 / 1.5, 1.0]) and speeds.planning(2) is None
    changes = [speeds.observe({0: 1.0, 1: 1.0, 2: 1.0}) for _ in range(3)]
    assert changes.count(True) == 1 and speeds.in_force == [1.0, 1.0, 1.0]
    assert speeds.planning(3) is None  # all alike again: plans as without speeds
    assert speeds.changes == 2
    # the fastest is the reference whichever rank it is: all slower together changes nothing
    assert not speeds.observe({0: 2.0, 1: 2.0, 2: 2.0})


def test_speeds_follow_the_ranks_kept_and_resume():
    speeds = ProcessSpeeds()
    for _ in range(3):
        speeds.observe({0: 1.0, 1: 2.0, 2: 1.0, 3: 1.25})
    assert speeds.in_force == [1.0, 0.5, 1.0, 0.8]
    again = ProcessSpeeds()
    again.load_state_dict(speeds.state_dict())
    assert again.in_force == speeds.in_force and again._recent.keys() == speeds._recent.keys()
    speeds.keep([0, 2, 3])
    assert speeds.in_force == [1.0, 1.0, 0.8] and sorted(speeds._recent) == [0, 1, 2]
    speeds.grow(4)
    assert speeds.in_force == [1.0, 1.0, 0.8, 1.0]


def test_replicas_plan_at_the_slowest_replicas_speed():
    fast = {"fwd": 1.0, "bwd": 2.0, "bwd_weight": 0.0, "param_bytes": 8.0, "probe_s": 1.0, "pp_rank": 1.0}
    slow = {"fwd": 3.0, "bwd": 6.0, "bwd_weight": 0.0, "param_bytes": 8.0, "probe_s": 2.0, "pp_rank": 1.0}
    both = _across_replicas([fast, slow])
    # in kernel units: fwd 1 and 1.5, mean 1.25, carried at the slowest replica's kernel time 2
    assert both["probe_s"] == 2.0 and both["fwd"] == 2.5 and both["bwd"] == 5.0 and both["param_bytes"] == 8.0
    assert ProcessSpeeds.normalise({0: both, 1: {**fast, "pp_rank": 0.0}})[0]["fwd"] == 1.25


def policy_with(costs, split, speeds, **settings):
    policy = BalancePolicy("optimal", warmup_steps=0, every_n_steps=5, **settings)
    policy.start(len(costs))
    for _ in range(3):
        policy.observe(measured(costs, split, speeds))
    return policy


def test_the_policy_plans_stage_times_over_speeds():
    costs = [1.0] * 9
    split = [5, 4]
    plan, _ = policy_with(costs, split, [1.0, 0.5]).plan(PipelineShape(split, 2, 8))
    assert plan[1] < plan[0] and plan[1] <= 3  # the slow rank gets about a third of the work
    assert policy_with(costs, split, [1.0, 1.0]).plan(PipelineShape(split, 2, 8))[0] in ([5, 4], [4, 5])


def test_a_speed_change_is_an_event_checked_at_once():
    costs, split = [1.0] * 8, [4, 4]
    policy = policy_with(costs, split, [1.0, 1.0])
    assert not policy.due(7)  # every_n_steps=5: next regular check at 10
    policy.observe(measured(costs, split, [1.0, 0.5]))
    assert not policy.due(7)  # one slow step is not a change
    policy.observe(measured(costs, split, [1.0, 0.5]))
    assert policy.due(7)  # two of three: the speeds in force changed, check now


def test_repack_releases_the_slowest_and_names_it():
    plan = plan_repack([1.0] * 8, [2.0] * 8, [2, 2, 2, 2], n_microbatches=8, tolerance=0.3, speeds=[1, 1, 0.5, 1])
    assert plan is not None and 2 not in plan.keep_ranks
    blind = plan_repack([1.0] * 8, [2.0] * 8, [2, 2, 2, 2], n_microbatches=8, tolerance=0.3)
    assert blind is not None and blind.keep_ranks != plan.keep_ranks
    on_nodes = plan_repack([1.0] * 8, [2.0] * 8, [2, 2, 2, 2], n_microbatches=8, tolerance=0.3,
                           speeds=[1, 1, 0.5, 1], nodes=["a", "a", "b", "b"])  # fmt: skip
    assert on_nodes is not None and on_nodes.keep_ranks == [0, 1] and on_nodes.freed_nodes == ["b"]
    with pytest.raises(ValueError, match="one speed per rank"):
        plan_repack([1.0] * 8, [2.0] * 8, [4, 4], n_microbatches=8, speeds=[1, 0.5, 1])
    # the policy repacks with the measured speeds, and a release tells the job manager which process was slow
    costs = [0.1] * 8
    policy = policy_with(costs, [2, 2, 2, 2], [1.0, 0.5, 1.0, 1.0], repack=True, repack_tolerance=0.3)
    decisions = policy.decide(PipelineShape([2, 2, 2, 2], 4, 8))
    repack = next(d for d in decisions if d.action == REPACK)
    assert 1 not in repack.keep_ranks
    policy.carried_out(repack)
    assert policy.speeds.in_force == [1.0] * len(repack.keep_ranks)
    told = []
    event = ReleaseEvent(1, [1], ["h"], [], ["h"], 4, 3)
    _naming_slow(told.append, {1: 0.5})(event)
    assert told[0].slow_pipeline_ranks == {"1": 0.5} and "slow_pipeline_ranks" in told[0].to_json()


def straggler(start, period=None):
    def speeds(k):
        slow = k >= start and (period is None or ((k - start) // period) % 2 == 0)
        return [1.0, 1.0, 0.5, 1.0] if slow else [1.0] * 4

    return speeds


TRACE = [{"step": k, "fwd": [1.0] * 16, "bwd": [2.0] * 16} for k in range(240)]


def test_the_replay_rebalances_once_per_straggler_event():
    common = {"n_microbatches": 16, "every_n_steps": 10, "warmup_steps": 0}
    uniform = simulate_run(TRACE, "uniform", 4, speeds=straggler(40), **common)
    steady = simulate_run(TRACE, "optimal", 4, speeds=straggler(40), **common)
    assert steady.n_migrations == 1 and steady.partitions[1][0] <= 43  # at once, not at the next regular check
    assert steady.partitions[1][1][2] < 4 and steady.total_time < 0.8 * uniform.total_time
    # comes and goes every 50 steps: 4 events (onset, recovery, ...) and one move each, no oscillation
    intermittent = simulate_run(TRACE, "optimal", 4, speeds=straggler(40, 50), **common)
    assert intermittent.n_migrations == 4, intermittent.partitions
    assert intermittent.partitions[-1][1] == [4, 4, 4, 4]  # recovered: its share back
    # static_time planned before the straggler came: it keeps the uniform split
    static = simulate_run(TRACE, "static_time", 4, speeds=straggler(40), **common)
    assert static.total_time == uniform.total_time


def test_noise_in_the_speeds_moves_no_layer():
    def noisy(k):
        return [1.0, 0.96 if k % 2 else 1.0, 1.0, 0.97 if k % 3 else 1.0]

    run = simulate_run(TRACE, "optimal", 4, speeds=noisy, n_microbatches=16, every_n_steps=10, warmup_steps=0)
    assert run.n_migrations == 0
