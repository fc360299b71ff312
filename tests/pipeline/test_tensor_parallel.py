"""Tensor parallelism inside every stage (``strategy.tensor_parallel_size``) equals one process.

P = 2 x T = 2 on 4 gloo processes against one process of the same batch (fp32, relative <= 1e-5 per step, the model
within 1e-5): the reference GPT through its built-in plan under 1F1B and ZBV with layers moving to a random split
every 5 steps and freezing on, also with FSDP2 over two replicas (D = 2 x P = 2 x T = 2 on 8 processes), Hugging
Face Llama and GPT-2 layers through their built-in plans, and a user's own model split by its own
``pipeline_parallelize_layer`` against plain single-device Lightning. Compiled split layers equal eager ones. A
checkpoint written at T = 2 resumes at T = 1, exact; a single file gathers the split tensors whole. What cannot work
is refused before any worker starts.
"""

from __future__ import annotations

import json

import pytest
import torch
from support import SUPPORT
from support.helpers import (
    DP2,
    EPOCH,
    FREEZE,
    GPT2,
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
from support.user_model import UserTPNet, fit
from torch import nn

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole
from dynmo_lightning.pipeline.parallel.tensor_parallel import builtin_plan
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout
from dynmo_lightning.protocol import JobShape
from dynmo_lightning.strategy.checks import check_tensor_parallel, check_world

TP2 = ["strategy.tensor_parallel_size=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    out = launch(1, {d / "one": [*FREEZE, "trainer.max_steps=20"], d / "one-full": [*EPOCH, "trainer.max_steps=12"]})
    out |= launch(1, {d / "llama-one": LLAMA, d / "gpt2-one": GPT2}, base=HF_BASE)
    four = {
        d / "tp2-1f1b": [*TP2, *MOVING],
        d / "tp2-first": [*TP2, *EPOCH, "trainer.max_steps=10"],
    }
    if V_ON_GLOO:
        four[d / "tp2-zbv"] = [*TP2, *MOVING, *ZBV, "checkpoint.format=single"]
    out |= launch(4, four)
    # D = 2 x P = 2 x T = 2: FSDP2 shards every process's parts again (2-D DTensors), and they move
    out |= launch(8, {d / "tp2-fsdp": [*TP2, *DP2, "strategy.data_parallel=fsdp", *MOVING]})
    out |= launch(4, {d / "llama-tp2": [*LLAMA, *TP2, *RANDOM], d / "gpt2-tp2": [*GPT2, *TP2, *RANDOM]}, base=HF_BASE)
    # `dynmo-train trainer.devices=4 strategy.tensor_parallel_size=2` with every default (tied embeddings included)
    out |= launch(4, {d / "as-it-reads": ["trainer.max_steps=30", "trainer.enable_progress_bar=false"]}, base=TP2)
    # compiled split layers (torchtitan's order: tensor parallel, then compile), P = 1 x T = 2, strictly compiled
    strict = "model._target_=support.strict_compile.StrictCompileGPT"
    out |= launch(2, {d / "tp2-compiled": [*TP2, *EPOCH, "strategy.compile=true", "trainer.max_steps=6", strict]})
    ckpt = f"ckpt_path={d / 'tp2-first' / 'checkpoints' / 'last.ckpt'}"
    out |= launch(2, {d / "resume-t1": [*EPOCH, "trainer.max_steps=12", ckpt]})
    return {path.name: run for path, run in out.items()}


def _equal(run, ref) -> None:
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    # Adam amplifies float noise in gradients that are zero in one process (a key's bias: softmax ignores it), so
    # the model is compared whole, and every tensor of a visible size to within noise.
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    big = {k: v for k, v in ref.checkpoint["state_dict"].items() if ".k.bias" not in k}
    assert_close_params({k: run.checkpoint["state_dict"][k] for k in big}, big, rtol=1e-4)


@slow
@pytest.mark.parametrize("name", ["tp2-1f1b", pytest.param("tp2-zbv", marks=needs_v), "tp2-fsdp"])
def test_split_stages_with_moving_layers_equal_one_process(runs, name):
    run = runs[name]
    _equal(run, runs["one"])
    assert len(run.summary["partitions"]) >= 3  # the random balancer moved split layers several times
    world, replicas = (8, 2) if name == "tp2-fsdp" else (4, 1)
    assert run.summary["world_size"] == [{"step": 0, "world_size": world, "replicas": replicas}]
    if name == "tp2-zbv":  # one file: the split tensors gathered whole, the unsplit model's keys and shapes
        assert (run.run_dir / "checkpoints" / "final.ckpt").is_file()


@slow
def test_compiled_split_layers_equal_eager_ones_and_compile_once(runs):
    compiled, eager = runs["tp2-compiled"].summary, runs["tp2-first"].summary
    assert_close_losses(compiled["losses"], eager["losses"][:6], rtol=1e-4)
    graphs = compiled["compiled_graphs_per_step"]
    assert graphs[0] > 0 and not any(graphs[1:])  # identical blocks share a graph; no step compiles again


@slow
def test_the_command_runs_as_it_reads(runs):
    summary = runs["as-it-reads"].summary
    assert summary["steps"] == 30 and summary["losses"][-1] < summary["losses"][0]
    assert summary["world_size"] == [{"step": 0, "world_size": 4, "replicas": 1}]
    assert summary["partitions"][0]["layers_per_stage"] == [3, 3]  # P = 2 stages, each split over 2 processes


@slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_layers_split_by_their_built_in_plan_and_move(runs, family):
    run = runs[f"{family}-tp2"]
    assert len(run.summary["partitions"]) >= 2
    _equal(run, runs[f"{family}-one"])


@slow
def test_a_checkpoint_of_split_stages_resumes_unsplit(runs):
    full, resumed = runs["one-full"], runs["resume-t1"]
    assert (runs["tp2-first"].run_dir / "checkpoints" / "last.ckpt").is_dir()  # every process wrote its parts
    assert_close_losses(resumed.summary["losses"], full.summary["losses"][10:])
    assert_close_model(resumed.checkpoint["state_dict"], full.checkpoint["state_dict"])


@slow
def test_a_users_own_plan_equals_plain_lightning_on_one_device(tmp_path):
    reference = fit(batch_size=16)  # plain Lightning, one device, no DynMoStrategy (the hook is never called)
    launch_script(4, SUPPORT / "_user_script.py", str(tmp_path), "tp2:tp=2,random=1", log_dir=tmp_path / "logs")
    losses = json.loads((tmp_path / "tp2.json").read_text())["losses"]
    state = load_whole(tmp_path / "tp2.ckpt")["state_dict"]
    assert_close_losses(losses, reference["losses"])
    assert_close_params(state, reference["model"].state_dict())


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    d = tmp_path_factory.mktemp("held")
    out = {}
    for mode in ("ddp", "tp"):  # P = 2 x D = 2 with whole layers; P = 2 x T = 2 with split ones
        launch_script(4, SUPPORT / "_sharding_script.py", str(d / "out"), mode, log_dir=d / "logs")
        out[mode] = [json.loads((d / f"out.{mode}.rank{r}.json").read_text()) for r in range(4)]
    return out


@slow
def test_split_layers_hold_half_and_move_as_their_parts(held):
    for rank, tp in enumerate(held["tp"]):
        ddp = held["ddp"][rank // 2]  # the same pipeline rank: ranks (p, t) = (r // 2, r % 2); ddp's are (d, p)
        whole, part = sum(ddp["held"].values()), sum(tp["held"].values())
        assert part <= 0.55 * whole, (tp, ddp)  # weights, gradients, AdamW state: half of every hidden layer
        moved = tp["migration"]
        assert moved["allocated"] <= 0.55 * moved["layer_bytes"], tp  # the moving layer's part, never it whole


# --- the layout and the plans, in one process -------------------------------------------------------------------
def test_tensor_parallel_ranks_are_innermost():
    layout = ReplicaLayout.even(8, 2, 2)  # D = 2 x P = 2 x T = 2
    assert layout.replicas == [[0, 2], [1, 3], [4, 6], [5, 7]]  # a pipeline per (replica, tensor-parallel rank)
    assert (layout.dp_size, layout.pp_size, layout.tp_size) == (2, 2, 2)
    assert layout.tp_ranks(1, 0) == [2, 3] and layout.stage_ranks(1, 1) == [3, 7]
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.tp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [layout.pp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.shards == [(0, 2), (1, 2)]  # the two tensor-parallel pipelines of a replica read the same data


def test_the_built_in_plan_splits_heads_and_the_mlp_and_leaves_the_rest_whole():
    block = Block(32, 4, 128, 0.0, True)
    assert set(builtin_plan(block, 2)) == {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"}
    assert builtin_plan(nn.Linear(4, 4), 2) == {}  # no plan: runs whole on every process of its stage


def test_what_cannot_be_split_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the layer's 4 attention heads"):
        check_tensor_parallel(object(), [Block(32, 4, 128, 0.0, True)], 3)
    check_tensor_parallel(UserTPNet(), [Block(32, 4, 128, 0.0, True)], 3)  # the user's own plan answers for itself
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 splits nothing: no layer of object has a built-in"):
        check_tensor_parallel(object(), [nn.Linear(4, 4), nn.Linear(4, 4)], 2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 does not divide the job's 6"):
        check_world(6, 2, 2)
    with pytest.raises(ValueError, match=r"needs strategy.data_parallel='fsdp' \(or 'replicate'\)"):
        DynMoStrategy(tensor_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be a positive integer"):
        DynMoStrategy(tensor_parallel_size=0)
    job = JobShape(4, 2, 1, None, "ddp", 2)
    DynMoBalancer(repack=True).pipeline_check_job(job)  # consolidation re-homes the parts (test_elastic_in_parts)
    # released processes as replicas: DDP cannot average the parts, replicate and FSDP2 can (test_composition)
    with pytest.raises(ValueError, match=r"on_release='data_parallel' with strategy.tensor_parallel_size=2 under "):
        DynMoBalancer(repack=True, on_release="data_parallel").pipeline_check_job(job)
    for mode in ("fsdp", "replicate"):
        DynMoBalancer(repack=True, on_release="data_parallel").pipeline_check_job(JobShape(4, 2, 1, None, mode, 2))
    # growing back re-forms one pipeline, a process per stage: not around tensor-parallel groups or replicas
    for job in (JobShape(4, 2, 1, None, "ddp", 2), JobShape(4, 2, 1, None, "fsdp", 1)):
        with pytest.raises(ValueError, match=r"on_release='wait' with strategy.data_parallel_size=\d x tensor_pa"):
            DynMoBalancer(repack=True, on_release="wait").pipeline_check_job(job)
    DynMoBalancer(repack=True, on_release="wait").pipeline_check_job(JobShape(4, 4, 1, None, "ddp", 1))


def test_a_fused_attention_checkpoint_of_earlier_versions_loads_into_the_split_projections():
    block = Block(8, 2, 16, 0.0, True)
    state = block.state_dict()
    fused = {k: v for k, v in state.items() if not k.startswith(("attn.q.", "attn.k.", "attn.v."))}
    fused["attn.qkv.weight"] = torch.cat([state[f"attn.{n}.weight"] for n in "qkv"])
    # the fused bias had a key part, which moves each query's logits alike: dropped, the attention is the same
    fused["attn.qkv.bias"] = torch.cat([state["attn.q.bias"], torch.randn(8), state["attn.v.bias"]])
    other = Block(8, 2, 16, 0.0, True)
    other.load_state_dict(fused)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(other(x), block(x))
    assert other.attn.k.bias is None
