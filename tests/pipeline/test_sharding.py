"""Data parallelism inside every stage: ``data_parallel="fsdp"`` (FSDP2) and ``"replicate"`` equal one replica.

P = 2 x D = 2 on 4 gloo processes against one replica of the same global batch (fp32, relative <= 1e-5 per step and
on the final parameters): under 1F1B and ZBV, with layers moving to a random split every 5 steps and freezing on,
also with ``fsdp_memory="lean"`` (gradients reduce-scattered per micro-batch); MoE with experts no token of one
replica reached (per-expert path); a Hugging Face Llama from ``from_hf``. A sharded
checkpoint written at (P = 2, D = 2, fsdp) resumes at (P = 4, D = 1), (P = 1, D = 2, fsdp) and (P = 2, D = 2, ddp),
exact. Memory: what each process holds under fsdp is half of ddp's, and a migration allocates shards, not layers.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import SUPPORT
from support.helpers import (
    DP2,
    EPOCH,
    HF_BASE,
    LLAMA,
    MOVING,
    RANDOM,
    V_ON_GLOO,
    ZBV,
    assert_close_losses,
    assert_close_model,
    assert_close_params,
    launch,
    launch_script,
    needs_v,
    slow,
)

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.protocol import JobShape
from dynmo_lightning.strategy.checks import check_units

# 16 experts in every block, dropless, no load-balancing loss, computed expert by expert: experts one replica's
# tokens never reached get no gradient there while the other replica's do (see test_data_parallel's MOE).
MOE = [
    "dynamics=moe",
    "dynamics.n_experts=16",
    "dynamics.every=1",
    "dynamics.capacity_factor=null",
    "dynamics.aux_loss_coef=0",
    "model._target_=support.moe_models.PerExpertGPT",
    "trainer.max_steps=12",
]
#: FSDP2's lean way: weights gathered per forward and backward, gradients reduce-scattered per micro-batch.
LEAN = ["strategy.fsdp_memory=lean"]
#: A small Hugging Face Llama, as tests/models/test_hf.py trains it with dynmo-train.
HF = [*LLAMA, *HF_BASE]


def _mode(name: str) -> list[str]:
    return [f"strategy.data_parallel={name}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharding")
    out = launch(2, {d / "pp2-moving": MOVING, d / "pp2-moe": MOE})
    out |= launch(2, {d / "hf-pp2": RANDOM}, base=HF)
    four = {d / f"{mode}-{sched}": [*DP2, *_mode(mode), *MOVING, *(ZBV if sched == "zbv" else [])]
            for mode in ("fsdp", "replicate") for sched in ("1f1b", "zbv") if sched != "zbv" or V_ON_GLOO}  # fmt: skip
    four[d / "fsdp-moe"] = [*DP2, *_mode("fsdp"), *MOE]
    four[d / "lean-1f1b"] = [*DP2, *_mode("fsdp"), *LEAN, *MOVING]
    four[d / "lean-moe"] = [*DP2, *_mode("fsdp"), *LEAN, *MOE]
    four[d / "fsdp-full"] = [*DP2, *_mode("fsdp"), *EPOCH, "trainer.max_steps=12"]
    four[d / "fsdp-first"] = [*DP2, *_mode("fsdp"), *EPOCH, "trainer.max_steps=10"]
    out |= launch(4, four)
    out |= launch(4, {d / "hf-fsdp": [*RANDOM, "strategy.data_parallel_size=2", "data.batch_size=4", *_mode("fsdp")]},
                  base=HF)  # fmt: skip
    ckpt = f"ckpt_path={d / 'fsdp-first' / 'checkpoints' / 'last.ckpt'}"
    resume = [*EPOCH, "trainer.max_steps=12", ckpt]
    out |= launch(4, {d / "resume-p4-ddp": resume, d / "resume-p2d2-ddp": [*DP2, *resume]})
    out |= launch(2, {d / "resume-p1d2-fsdp": [*DP2, *_mode("fsdp"), *resume]})
    return {path.name: run for path, run in out.items()}


@slow
@pytest.mark.parametrize(
    "name",
    ["fsdp-1f1b", "replicate-1f1b", pytest.param("fsdp-zbv", marks=needs_v),
     pytest.param("replicate-zbv", marks=needs_v), "lean-1f1b"],
)  # fmt: skip
def test_two_sharded_replicas_with_moving_layers_equal_one_replica(runs, name):
    ref, run = runs["pp2-moving"], runs[name]
    assert run.summary["world_size"] == [{"step": 0, "world_size": 4, "replicas": 2}]
    assert len(run.summary["partitions"]) >= 3  # the random balancer moved layers (sharded) several times
    assert run.summary["replicas_in_sync"]
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    # The reduction averages the replicas' sums (another association of the same terms): the model within 1e-5,
    # every tensor within float noise through Adam (an unreduced or misplaced shard would be off by the step size).
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"], rtol=1e-4)
    if name.startswith(("fsdp", "lean")):  # every replica wrote its shards: a directory, whole tensors once read
        assert (run.run_dir / "checkpoints" / "final.ckpt").is_dir()


@slow
@pytest.mark.parametrize("name", ["fsdp-moe", "lean-moe"])
def test_experts_no_token_of_one_replica_reached_are_reduced_as_zero(runs, name):
    ref, run = runs["pp2-moe"], runs[name]
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert_close_params(run.checkpoint["state_dict"], ref.checkpoint["state_dict"], rtol=1e-4)


@slow
def test_a_hugging_face_llama_shards_and_moves(runs):
    ref, run = runs["hf-pp2"], runs["hf-fsdp"]
    assert len(run.summary["partitions"]) >= 2
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])


@slow
@pytest.mark.parametrize("name", ["resume-p4-ddp", "resume-p2d2-ddp", "resume-p1d2-fsdp"])
def test_a_sharded_checkpoint_resumes_at_other_shapes_and_modes(runs, name):
    full, resumed = runs["fsdp-full"], runs[name]
    assert_close_losses(resumed.summary["losses"], full.summary["losses"][10:])
    assert_close_model(resumed.checkpoint["state_dict"], full.checkpoint["state_dict"])
    assert_close_params(resumed.checkpoint["state_dict"], full.checkpoint["state_dict"], rtol=1e-4)


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    d = tmp_path_factory.mktemp("held")
    out = {}
    for mode in ("ddp", "replicate", "fsdp"):
        launch_script(4, SUPPORT / "_sharding_script.py", str(d / "out"), mode, log_dir=d / "logs")
        out[mode] = [json.loads((d / f"out.{mode}.rank{r}.json").read_text()) for r in range(4)]
    return out


def _total(rank: dict) -> int:
    return sum(rank["held"].values())


@slow
def test_fsdp_holds_half_of_what_ddp_holds_and_moves_shards(held):
    for r in range(4):
        assert _total(held["fsdp"][r]) <= 0.55 * _total(held["ddp"][r]), (r, held["fsdp"][r], held["ddp"][r])
        assert _total(held["replicate"][r]) == _total(held["ddp"][r])  # whole layers, as DDP
    for mode, ranks in held.items():
        for rank in ranks:
            moved = rank["migration"]
            # One migration allocates at most one whole layer on any process (the receiver's new layer) ...
            assert moved["allocated"] <= 1.05 * moved["layer_bytes"], (mode, rank)
            if mode == "fsdp":  # ... and under fsdp only its shard: nothing whole travels or is made
                assert moved["allocated"] <= 0.55 * moved["layer_bytes"], rank


# --- refused before any worker starts ------------------------------------------------------------------------------
def test_unknown_mode_and_combinations_that_cannot_work_are_refused():
    with pytest.raises(
        ValueError, match=r"strategy.data_parallel='zero3' is not one of \['ddp', 'replicate', 'fsdp'\]"
    ):
        DynMoStrategy(data_parallel="zero3")
    DynMoStrategy(data_parallel="fsdp")  # a mesh of one (D = 1) is allowed
    for on_release in ("exit", "data_parallel"):  # consolidation under fsdp: tests/pipeline/test_elastic_in_parts.py
        DynMoBalancer(repack=True, on_release=on_release).pipeline_check_job(JobShape(4, 4, 1, None, "fsdp"))
    # ... but not onto one process when the first and last layers share a parameter (one unit per parameter)
    tied = JobShape(4, 4, 1, None, "fsdp", tied_ends=True)
    with pytest.raises(ValueError, match=r"balancer.min_stages=1 with strategy.data_parallel='fsdp': a consolidation"):
        DynMoBalancer(repack=True).pipeline_check_job(tied)
    DynMoBalancer(repack=True, min_stages=2).pipeline_check_job(tied)
    DynMoBalancer(repack=True).pipeline_check_job(JobShape(4, 4, 1, None, "ddp", tied_ends=True))
    # the capacity check counts a shard per process under fsdp
    DynMoBalancer(memory_capacity=600.0).pipeline_check_job(JobShape(4, 2, 1, [1000, 1000], "fsdp"))
    with pytest.raises(ValueError, match="cannot hold the model"):
        DynMoBalancer(memory_capacity=600.0).pipeline_check_job(JobShape(4, 2, 1, [1000, 1000], "ddp"))


def test_layers_fsdp_cannot_wrap_are_refused_naming_the_parameter():
    scalar = torch.nn.Linear(2, 2)
    scalar.scale = torch.nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"cannot wrap pipeline layer 1 \(Linear\): its parameter 'scale' is a scalar"):
        check_units([torch.nn.Linear(2, 2), scalar], "fsdp", "1f1b")
    check_units([torch.nn.Linear(2, 2), scalar], "ddp", "1f1b")
    embed, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    head.weight = embed.weight
    with pytest.raises(ValueError, match=r"the V puts the first and the last stage on one process"):
        check_units([embed, torch.nn.Linear(2, 2), head], "replicate", "zbv")
    check_units([embed, torch.nn.Linear(2, 2), head], "fsdp", "1f1b")  # across processes: two copies, one tie
