"""The policy decides by the schedule's makespan: the few-micro-batch case, and the committed traces replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynmo_lightning.balance import partition, should_repartition, stage_times, step_time
from dynmo_lightning.balance.decision.policy import MIGRATE, REPACK, BalancePolicy, PipelineShape
from dynmo_lightning.balance.diffusion.driver import drive
from dynmo_lightning.balance.steptime.closed_form import repartition_pays
from dynmo_lightning.balance.steptime.makespan import makespan
from dynmo_lightning.balance.steptime.planner import StepModel
from dynmo_lightning.sim import load_trace, simulate_layers, simulate_run

TRACES = Path(__file__).resolve().parents[2] / "docs" / "bench" / "traces"


def test_few_microbatches_heavy_first_stage_keeps_the_split():
    # The pruning case at M = 4 on 2 ranks: a heavy first layer, pruned (cheaper) layers at the back. The closed
    # form charges the heavy first stage (M - 1) times and predicts 6.7 % from moving to [5, 7]; in 1F1B's task
    # order that stage's extra work hides in the other stage's fill and drain: the move saves 1.8 %, below min_gain.
    fwd = [2.5] + [1.0] * 5 + [0.95] * 6
    bwd = [2 * f for f in fwd]
    now, moved = stage_times(fwd, bwd, [6, 6]), stage_times(fwd, bwd, [5, 7])
    assert 1 - step_time(*moved, 4) / step_time(*now, 4) == pytest.approx(0.0672, abs=1e-3)
    assert 1 - makespan(*moved, 4) / makespan(*now, 4) == pytest.approx(0.0177, abs=1e-3)
    closed_form = should_repartition(
        fwd, bwd, [6, 6], [5, 7], n_microbatches=4, schedule="1f1b", steps_until_next_check=50, migration_cost=0.0,
        min_gain=0.05,
    )  # fmt: skip
    assert closed_form[0]  # what the policy used to do

    policy = BalancePolicy("optimal", every_n_steps=50, min_gain=0.05, bandwidth=1e12)
    policy.start(12)
    policy.observe({i: {"fwd": f, "bwd": b, "param_bytes": 1.0} for i, (f, b) in enumerate(zip(fwd, bwd, strict=True))})
    (decision,) = policy.decide(PipelineShape([6, 6], 2, 4))
    assert decision.action == "keep"
    assert decision.current_step_s == makespan(*now, 4)
    assert 1 - decision.predicted_step_s / decision.current_step_s < 0.05


@pytest.mark.parametrize("dynamic", sorted(p.name.split(".")[0] for p in TRACES.glob("*.jsonl.gz")))
def test_replayed_decisions_pay_by_the_makespan_and_match_the_simulator(dynamic, monkeypatch):
    trace = load_trace(TRACES / f"{dynamic}.jsonl.gz")
    n_stages, m, p2p = 8, 32, 1.2e-3  # the scale table's smallest pipeline, M = 4 P, its measured hop
    decisions, checks = [], []
    decide, due = BalancePolicy.decide, BalancePolicy.due

    def spy_due(self, step):
        if (answer := due(self, step)) is True:
            checks.append(step)  # the replay checks before trace step `step`, from the steps before it
        return answer

    def spy(self, pipe, *args, **kwargs):
        out = decide(self, pipe, *args, **kwargs)
        tracked = {f: list(self.tracker.values[f]) for f in ("fwd", "bwd")}  # what this check planned from
        decisions.extend((checks[-1], tracked, self, pipe, d) for d in out)
        return out

    monkeypatch.setattr(BalancePolicy, "due", spy_due)
    monkeypatch.setattr(BalancePolicy, "decide", spy)
    run = simulate_run(trace, "optimal+repack", n_stages, n_microbatches=m, p2p=p2p, every_n_steps=10, regrow=True)
    assert decisions
    applied = [split for _, split in run.partitions]
    for k, tracked, policy, pipe, d in decisions:
        if d.action == MIGRATE:  # every migration taken is one the makespan model predicts to pay
            assert repartition_pays(d.current_step_s, d.predicted_step_s, policy.settings.every_n_steps, d.migration_s,
                                    policy.settings.min_gain)[0]  # fmt: skip
        if d.action in (MIGRATE, REPACK):
            assert d.proposed in applied
        # The model's step times against the simulator's on the costs the check planned from (the closed form was
        # up to 14 % off here); how far those costs are from the next step's is the tracker's business, not the model's.
        for split, predicted in ((d.current, d.current_step_s), (d.proposed, d.predicted_step_s)):
            if predicted:
                simulated = simulate_layers(tracked["fwd"], tracked["bwd"], split, pipe.n_microbatches, "1f1b", p2p)
                assert predicted == pytest.approx(simulated.step_time, rel=0.01), (k, d.action, split)


def test_the_profiled_weight_part_reaches_the_zero_bubble_step_model():
    # Under ZBV the weight part of a layer's backward runs as its own W task; the policy's makespan must see what the
    # profiler measured (``bwd_weight``), not a backward that runs whole in the input slot.
    fwd = [1.0, 1.0, 1.0, 3.0]
    bwd = [2 * f for f in fwd]
    profile = {
        i: {"fwd": f, "bwd": b, "bwd_weight": b / 2, "param_bytes": 1.0}
        for i, (f, b) in enumerate(zip(fwd, bwd, strict=True))
    }
    policy = BalancePolicy("optimal", every_n_steps=50, bandwidth=1e12)
    policy.start(4)
    policy.observe(profile)
    pipe = PipelineShape([1, 1, 1, 1], 2, 4, "zbv")
    split = [1, 1, 1, 1]
    with_w = makespan(*stage_times(fwd, bwd, split), 4, "zbv", stage_wgt=[b / 2 for b in bwd], stages_per_rank=2)
    whole = makespan(*stage_times(fwd, bwd, split), 4, "zbv", stages_per_rank=2)
    assert with_w != whole  # the split matters to the schedule
    assert policy.step_model(pipe)(split) == pytest.approx(with_w)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_zero_bubble_check_prices_both_splits_with_the_weight_parts(schedule):
    # Issue 38: no dynamic, 16 ranks in a V, the benchmark's 62 blocks, embedding and head. The keep / migrate rule
    # priced both splits as if every backward ran whole in its input slot: the first check's 6.4 % gain read as
    # 4.7-4.9 %, under min_gain, and the static imbalance stayed for good. Both step times are now the planner's own
    # step model, W tasks and all.
    step = load_trace(TRACES / "none.jsonl.gz")[0]
    policy = BalancePolicy("optimal", every_n_steps=10, min_gain=0.05, bandwidth=1e9)
    policy.start(len(step["fwd"]))
    fields = ("fwd", "bwd", "bwd_weight", "param_bytes", "optim_bytes")
    policy.observe({i: {f: step[f][i] for f in fields} for i in range(len(step["fwd"]))})
    pipe = PipelineShape(partition(step["fwd"], 32, method="uniform"), 16, 64, schedule)
    (decision,) = policy.decide(pipe)
    model = policy.step_model(pipe)
    assert decision.action == MIGRATE
    assert (decision.current_step_s, decision.predicted_step_s) == (model(decision.current), model(decision.proposed))
    whole = StepModel(step["fwd"], step["bwd"], 64, schedule, stages_per_rank=2)  # no W tasks
    gain = 1 - decision.predicted_step_s / decision.current_step_s
    assert 1 - whole(decision.proposed) / whole(decision.current) < 0.05 < gain


def test_the_neighbour_protocols_outcome_is_priced_with_the_weight_parts_too():
    # The diffusion protocol's stages carry each layer's weight part beside its forward and backward, so that the
    # keep / migrate rule on their per-stage sums times the same step as the central planner's model.
    fwd = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    profile = {i: {"fwd": f, "bwd": 2 * f, "bwd_weight": f, "param_bytes": 1.0} for i, f in enumerate(fwd)}
    policy = BalancePolicy("diffusion", every_n_steps=10, min_gain=0.0, bandwidth=1e12)
    policy.start(len(fwd))
    policy.observe(profile)
    pipe = PipelineShape([2, 2, 2, 2], 2, 8, "zbv")
    stages = [policy.diffusion_stage(pipe, s) for s in range(4)]
    list(drive(stages))
    (decision,) = policy.decide(pipe, planned=stages[0].outcome)
    model = policy.step_model(pipe)
    assert decision.proposed != pipe.layers_per_stage
    assert decision.current_step_s == pytest.approx(model(pipe.layers_per_stage))
    assert decision.predicted_step_s == pytest.approx(model(decision.proposed))
