"""Zero-bubble schedules (interleaved zero-bubble, ZBV, DualPipeV) at P = 2 ranks x 2 stages equal one process while
the balancer moves layers (a random split every 3 steps): invariants 1 and 2 under a split backward, for the looped
placement and for the V (stages s and 2P - 1 - s on rank s, first and last stage on rank 0).

Also under the V: tied embeddings (both ends on one rank: one tensor, no cross-rank sum), a sharded checkpoint
written while layers moved that resumes at P = 1 and again under ZBV, and the profiler's backward split into its
input and weight parts.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import FREEZE, assert_close_losses, assert_close_model, assert_close_params, launch, needs_v

# the shared runs include the V schedules (zbv, dualpipev), refused on gloo before torch 2.13
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs_v]

STEPS = ["trainer.max_steps=20", "trainer.val_check_interval=10"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=0"]
TRACE = ["profile.trace=true", "profile.every_n_steps=3"]
TIED = ["model.tie_embeddings=true"]
# blocks 1 and 2 declared tied as well: under interleaved 1F1B they share rank 0 whenever they sit in stages 0 and 2
BLOCK_TIE = [*TIED, "model._target_=support.tied_blocks.TiedBlocksGPT"]
EPOCH = [
    "trainer.limit_train_batches=10",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "checkpoint.every_n_train_steps=10",
]
SCHEDULES = ["zbv", "interleaved_zb", "dualpipev"]
EXIT = ["dynamics=early_exit", "dynamics.warmup_steps=3", "dynamics.ramp_steps=3", "dynamics.threshold=0.6"]
#: Dynamics that change which tensors carry gradients: a frozen prefix (a stage's inputs then carry none, and
#: torch's input pass alone would leave its trainable layers without weight gradients) and early exit.
MOD = ["dynamics=mod", "dynamics.start_step=2", "dynamics.anneal_steps=6"]
#: ... and Mixture of Depths, whose predictor learns from detached hidden states (a stage's backward runs whole).
DYNAMICS = {"freeze": FREEZE, "exit": EXIT, "mod": MOD}


def _schedule(name: str) -> list[str]:
    return [f"strategy.schedule={name}", "strategy.stages_per_rank=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("zb")
    cases = {d / name: [*STEPS, *_schedule(name), *RANDOM, *TRACE] for name in SCHEDULES}
    cases[d / "zbv-tied"] = [*STEPS, *TIED, *_schedule("zbv"), *RANDOM]
    cases[d / "interleaved-blocks"] = [*STEPS, *BLOCK_TIE, *_schedule("interleaved_1f1b"), *RANDOM]
    cases[d / "zbv-first"] = ["trainer.max_steps=10", *EPOCH, *_schedule("zbv"), *RANDOM]
    cases[d / "1f1b"] = [*STEPS, *RANDOM, *TRACE]  # the profiler does not split a full backward
    for dynamic, overrides in DYNAMICS.items():
        for name in SCHEDULES:
            cases[d / f"{name}-{dynamic}"] = [*STEPS, *overrides, *_schedule(name), *RANDOM]
    out = launch(2, cases)
    ckpt = f"ckpt_path={d / 'zbv-first' / 'checkpoints' / 'last.ckpt'}"
    out |= launch(
        1,
        {
            d / "p1": STEPS,
            d / "p1-tied": [*STEPS, *TIED],
            d / "p1-blocks": [*STEPS, *BLOCK_TIE],
            **{d / f"p1-{dynamic}": [*STEPS, *overrides] for dynamic, overrides in DYNAMICS.items()},
            d / "p1-full": ["trainer.max_steps=12", *EPOCH],
            d / "resume1": ["trainer.max_steps=12", *EPOCH, ckpt],
        },
    )
    out |= launch(2, {d / "resume-zbv": ["trainer.max_steps=12", *EPOCH, *_schedule("zbv"), ckpt]})
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", SCHEDULES)
def test_zero_bubble_with_moving_layers_equals_one_process(runs, name):
    ref, run = runs["p1"], runs[name]
    got = run.summary
    assert got["steps"] == ref.summary["steps"] == 20
    assert len({tuple(p["layers_per_stage"]) for p in got["partitions"]}) >= 3  # the layers really moved
    assert all(len(p["layers_per_stage"]) == 4 for p in got["partitions"])
    assert_close_losses(got["losses"], ref.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert got["param_norm"] == pytest.approx(ref.summary["param_norm"], rel=1e-6)
    assert got["val_loss"] == pytest.approx(ref.summary["val_loss"], rel=1e-5)  # evaluation under the schedule
    assert got["losses"][-1] < got["losses"][0] - 0.3  # it learns


@pytest.mark.parametrize("dynamic", list(DYNAMICS))
@pytest.mark.parametrize("name", SCHEDULES)
def test_zero_bubble_with_dynamics_equals_one_process(runs, name, dynamic):
    ref, run = runs[f"p1-{dynamic}"], runs[f"{name}-{dynamic}"]
    assert len({tuple(p["layers_per_stage"]) for p in run.summary["partitions"]}) >= 3
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])


@pytest.mark.parametrize(("name", "ref"), [("zbv-tied", "p1-tied"), ("interleaved-blocks", "p1-blocks")])
def test_ties_within_one_rank_across_its_stages(runs, name, ref):
    # One tensor in two local stages: its gradient is divided by the micro-batches once, not once per stage.
    ref, run = runs[ref], runs[name]
    assert len({tuple(p["layers_per_stage"]) for p in run.summary["partitions"]}) >= 3
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    state = run.checkpoint["state_dict"]
    assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])  # still one parameter
    assert run.summary["param_norm"] == pytest.approx(ref.summary["param_norm"], rel=1e-5)  # counted once


@pytest.mark.parametrize("name", ["resume1", "resume-zbv"])
def test_sharded_checkpoint_of_the_v_resumes_anywhere(runs, name):
    first, run, ref = runs["zbv-first"], runs[name], runs["p1-full"]
    assert (first.run_dir / "checkpoints" / "last.ckpt").is_dir()  # sharded: every stage wrote its own layers
    assert len({tuple(p["layers_per_stage"]) for p in first.summary["partitions"]}) >= 2
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert_close_losses(run.summary["losses"][-2:], ref.summary["losses"][-2:])


def _trace(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "costs.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", SCHEDULES)
def test_profiler_times_the_input_and_weight_parts_of_a_split_backward(runs, name):
    records = _trace(runs[name])
    assert [r["step"] for r in records] == list(range(0, 20, 3))
    for r in records:
        for total, part_in, part_w in zip(r["bwd"], r["bwd_input"], r["bwd_weight"], strict=True):
            assert total == pytest.approx(part_in + part_w, rel=1e-9, abs=1e-12)
        # every layer has parameters, so every layer has a weight part
        assert all(w > 0 for w in r["bwd_weight"]), r["bwd_weight"]
        # the layers after the first stage have an input part; torch runs the first stage's whole backward in its
        # weight slot (its input, token ids, has no gradient to send), so there all of it counts as weight
        first = r["layers_per_stage"][0]
        assert all(i > 0 for i in r["bwd_input"][first:]), r["bwd_input"]


def test_full_backward_has_no_weight_part(runs):
    for r in _trace(runs["1f1b"]):
        assert r["bwd_weight"] == [0.0] * len(r["bwd"])
        assert r["bwd_input"] == r["bwd"] and all(b > 0 for b in r["bwd"])
