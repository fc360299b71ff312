"""Tied parameters across stages: the embedding tied to the head (and a tie between two blocks that the balancer
moves around, so it keeps turning local and cross-stage) train exactly as in one process; the copies stay identical
and the checkpoint loads into the plain tied model."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.helpers import assert_close_losses, assert_close_model, launch

from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.stage.ties import TieError, find_ties

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = ["trainer.max_steps=20", "model.tie_embeddings=true"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=2", "balancer.warmup_steps=0"]
# blocks 1 and 2 declared tied (a model that ties by copying): random partitions split and merge them
BLOCK_TIE = ["model._target_=support.tied_blocks.TiedBlocksGPT"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ties")
    out = launch(
        1,
        {d / "p1": STEPS, d / "p1-untied": [*STEPS, "model.tie_embeddings=false"], d / "blocks1": [*STEPS, *BLOCK_TIE]},
    )
    out |= launch(2, {d / "p2": STEPS, d / "blocks2": [*STEPS, *BLOCK_TIE, *RANDOM]})
    out |= launch(4, {d / "p4": STEPS, d / "p4-random": [*STEPS, *RANDOM]})
    return {path.name: run for path, run in out.items()}


@pytest.mark.parametrize("name", ["p2", "p4", "p4-random"])
def test_tied_embeddings_equal_one_process(runs, name):
    ref, run = runs["p1"], runs[name]
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    # the tied gradient's two halves are summed in another order than in one process: equal up to reassociation
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    assert run.summary["param_norm"] == pytest.approx(ref.summary["param_norm"], rel=1e-6)  # the tie counted once
    # the first stage's embedding and the last stage's head are identical copies at the end
    state = run.checkpoint["state_dict"]
    assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
    assert runs["p1-untied"].summary["losses"] != ref.summary["losses"]  # the tie is really there


def test_tie_that_moves_between_local_and_cross_stage(runs):
    ref, run = runs["blocks1"], runs["blocks2"]
    partitions = [p["layers_per_stage"] for p in run.summary["partitions"]]
    # layers 2 and 3 are tied: split across the two ranks when rank 0 holds exactly 3 layers, together otherwise
    split = [p[0] == 3 for p in partitions]
    assert any(later and not before for before, later in itertools.pairwise(split)), partitions  # re-split
    assert not all(split)
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(run.checkpoint["state_dict"], ref.checkpoint["state_dict"])
    state = run.checkpoint["state_dict"]
    assert torch.equal(state["blocks.1.mlp.fc.weight"], state["blocks.2.mlp.fc.weight"])


def test_checkpoint_loads_into_the_plain_tied_model(runs):
    ckpt = runs["p4"].checkpoint
    model = GPT(**ckpt["hyper_parameters"])
    model.configure_model()
    # the checkpoint's two names of the tie hold the same values (loading would hide it: the last one wins)
    assert torch.equal(ckpt["state_dict"]["embed.wte.weight"], ckpt["state_dict"]["head.lm_head.weight"])
    model.load_state_dict(ckpt["state_dict"])
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert torch.equal(model.embed.wte.weight, ckpt["state_dict"]["embed.wte.weight"])


def test_copies_in_optimizer_groups_with_different_settings_are_refused(tmp_path):
    with pytest.raises(AssertionError, match=r"TieError: the copies of tied parameters .* different settings"):
        launch(2, {tmp_path / "bad": [*STEPS, "model._target_=support.tied_blocks.DecayedHeadGPT"]})


def test_ties_found_and_refused_when_shapes_differ():
    model = GPT(n_layer=2, n_embd=16, n_head=2, block_size=8)
    model.configure_model()
    layers = model.pipeline_layers()
    ties = find_ties(model, layers, ["embed", "blocks.0", "blocks.1", "head"])
    assert [t.names for t in ties] == [("embed.wte.weight", "head.lm_head.weight")]

    class Declared(GPT):
        def pipeline_tied_parameters(self):
            return [["blocks.0.mlp.fc.weight", "blocks.1.nothing"]]

    declared = Declared(n_layer=2, n_embd=16, n_head=2, block_size=8, tie_embeddings=False)
    declared.configure_model()
    with pytest.raises(TieError, match="no pipeline layer"):
        find_ties(declared, declared.pipeline_layers(), ["embed", "blocks0", "blocks1", "head"])
