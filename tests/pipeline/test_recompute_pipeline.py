"""Activation checkpointing at P = 2 while layers move (a random split every 3 steps), with dynamics active: losses
and parameters equal the run without it (invariant 2's tolerance; bit-identical here), and the profiled steps saw the
checkpointed layers keep only their inputs, wherever the layers ran.

- early exit with the active-token bound read once per stage (a recomputation that read its own bound would get
  other shapes and be refused by the checkpoint);
- freezing (a frozen prefix runs without autograd: nothing to recompute), with dropout (the recomputation draws
  the same masks);
- adaptive sparse attention (a recomputation that counted its coverage again would move the densities);
- early exit again under interleaved 1F1B (two stages per process);
- under the zero-bubble schedules (``zbv``, ``interleaved_zb``, ``dualpipev``: backward in an input and a weight
  pass), exact against one process, each checkpointed layer recomputed once per micro-batch for both passes (counted);
- and, apart, two data-parallel replicas of a one-stage pipeline with Mixture of Experts: DDP averages gradients
  while backward recomputes, and searches for experts no token reached.
"""

from __future__ import annotations

import json

import pytest
from support.helpers import DP2, FREEZE, assert_close_losses, assert_close_params, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: Every third step is profiled (through the checkpointed path) and traced to costs.jsonl: steps 0, 3, ..., the ones
#: right after the balancer's moves (a trace of a step after which the random balancer moved layers fails to gather:
#: the profile's layers left before it was read).
STEPS = ["trainer.max_steps=30", "profile.trace=true", "profile.every_n_steps=3"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=3", "balancer.warmup_steps=0"]
EXIT = ["dynamics=early_exit", "dynamics.warmup_steps=5", "dynamics.ramp_steps=5", "dynamics.threshold=0.6",
        "dynamics.sync=stage"]  # fmt: skip
CASES = {
    "exit": EXIT,
    "freeze": [*FREEZE, "model.dropout=0.1"],
    "sparse": ["dynamics=sparse_attention", "dynamics.attn_block=8", "dynamics.target_coverage=0.8"],
    # two stages per rank: each stage module recomputes its own layers, with its own memo
    "interleaved": [*EXIT, "strategy.schedule=interleaved_1f1b", "strategy.stages_per_rank=2"],
}
#: Zero-bubble, no dynamic: every layer runs with autograd, so every one recomputes once per micro-batch.
SPLIT = ["zbv", "interleaved_zb", "dualpipev"]
#: Every second pipeline layer (blocks 0 and 2, the head) with sparse attention, every layer otherwise.
SETTINGS = {"exit": "all", "freeze": "all", "sparse": "2", "interleaved": "all"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("recompute")
    cases = {}
    for name, dynamic in CASES.items():
        cases[d / name] = [*STEPS, *dynamic, *RANDOM]
        cases[d / f"{name}-ckpt"] = [*STEPS, *dynamic, *RANDOM, f"strategy.activation_checkpointing={SETTINGS[name]}"]
    moe = ["trainer.max_steps=20", "dynamics=moe", "dynamics.n_experts=4", "dynamics.capacity_factor=1.0", *DP2]
    cases[d / "moe-dp2"], cases[d / "moe-dp2-ckpt"] = moe, [*moe, "strategy.activation_checkpointing=all"]
    for schedule in SPLIT:
        split = [f"strategy.schedule={schedule}", "strategy.stages_per_rank=2", "strategy.n_microbatches=4"]
        cases[d / f"{schedule}-ckpt"] = [*STEPS, *RANDOM, *split, "strategy.activation_checkpointing=all"]
    out = launch(2, cases) | launch(1, {d / "p1": STEPS})
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_recomputation_equals_the_run_without_it(runs, name):
    plain, ckpt = runs[name], runs[f"{name}-ckpt"]
    assert len(ckpt.summary["partitions"]) >= 5  # the layers moved many times
    assert ckpt.summary["partitions"] == plain.summary["partitions"]
    assert_close_losses(ckpt.summary["losses"], plain.summary["losses"])
    assert_close_params(ckpt.checkpoint["state_dict"], plain.checkpoint["state_dict"])
    assert ckpt.checkpoint["state_dict"].keys() == plain.checkpoint["state_dict"].keys()  # no wrapper in the keys


def test_recomputation_under_data_parallel_replicas_equals_the_run_without_it(runs):
    plain, ckpt = runs["moe-dp2"], runs["moe-dp2-ckpt"]
    assert ckpt.summary["world_size_end"] == 2 and ckpt.summary["partitions"][0]["layers_per_stage"] == [6]
    assert_close_losses(ckpt.summary["losses"], plain.summary["losses"])
    assert_close_params(ckpt.checkpoint["state_dict"], plain.checkpoint["state_dict"])


@pytest.mark.parametrize("name", list(CASES))
def test_profiled_checkpointed_layers_keep_only_their_inputs(runs, name):
    plain, ckpt = (_trace(runs[n]) for n in (name, f"{name}-ckpt"))
    assert [r["step"] for r in ckpt] == [r["step"] for r in plain] == list(range(0, 30, 3))
    assert len({tuple(r["layers_per_stage"]) for r in ckpt}) >= 3  # measured on different stages as they moved
    n_layers = len(plain[0]["activation_bytes"])  # embedding, 4 blocks, head
    chosen = range(n_layers) if SETTINGS[name] == "all" else range(1, n_layers, 2)
    inputs = set()  # what the checkpointed blocks keep
    for before, after in zip(plain, ckpt, strict=True):
        for i, (kept, kept_ckpt) in enumerate(zip(before["activation_bytes"], after["activation_bytes"], strict=True)):
            where = (after["step"], i, kept_ckpt, kept)
            if name == "freeze" and after["step"] >= 3 and i < 4:  # frozen: run without autograd, nothing kept
                assert kept_ckpt == kept == 0, where
            elif i not in chosen:
                assert kept_ckpt == kept, where
            elif 0 < i < n_layers - 1:  # a block keeps its input, a small part of what its attention and MLP keep
                inputs.add(kept_ckpt)
                assert kept == 0 or kept_ckpt < kept / 4, where  # 0: all its tokens had exited, it computed nothing
            else:  # the embedding keeps its token ids (not its positions), the head its input (not its norm's output)
                assert kept_ckpt < kept, where
    assert len(inputs) == 1  # exactly its inputs (hidden states, and exits' active mask), whatever it computed


@pytest.mark.parametrize("schedule", SPLIT)
def test_recomputation_under_a_split_backward_equals_one_process_and_runs_once(runs, schedule):
    ref, run = runs["p1"], runs[f"{schedule}-ckpt"]
    summary = run.summary
    assert len({tuple(p["layers_per_stage"]) for p in summary["partitions"]}) >= 3  # the layers moved
    assert_close_losses(summary["losses"], ref.summary["losses"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    # Rank 0 holds stage 0 and, in the V, the last stage (looped: stage 2); each of its layers recomputes once per
    # micro-batch, not once per backward pass (the last stage's runs in two).
    n_micro = 4
    mine = (0, 2) if schedule == "interleaved_zb" else (0, 3)
    expected = [n_micro * sum(split[s] for s in mine) for split in _splits_per_step(summary)]
    assert summary["recomputations_per_step"] == expected
    assert ref.summary["recomputations_per_step"] == [0] * len(expected)  # no checkpointing there


def _splits_per_step(summary: dict) -> list[list[int]]:
    changes = summary["partitions"]
    splits, current = [], changes[0]["layers_per_stage"]
    for step in range(summary["steps"]):
        for change in changes:
            if change["step"] == step:
                current = change["layers_per_stage"]
        splits.append(current)
    return splits


def _trace(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "costs.jsonl").read_text().splitlines()]
