"""Exactness runs that can see a wrong gradient scale: plain SGD without clipping, and the pre-clip gradient norm.

AdamW and clipping by norm are invariant to a uniform gradient scale, so the exactness runs that train with them
would pass with a sum over replicas instead of a mean, a micro-batch divided twice, or a wrong sharded norm. Here the
user's model trains with plain SGD (``support.sgd_model``: a 2x scale moves its losses by ~20 %) and is compared per
step with plain single-device Lightning (fp32, relative <= 1e-5) at P = 2 x D = 2 under ``ddp``, ``fsdp`` (also
with ``fsdp_memory="lean"``: a reduce-scatter per micro-batch) and ``replicate``, at P = 2 x T = 2 (the user's own
tensor-parallel plan) and under ZBV; with clipping on (below every step's norm), the global norm before clipping
that ``summary.json`` records (``grad_norms``) equals one device's under FSDP2 and tensor parallelism, whose gradients
are held in parts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from support import SUPPORT
from support.helpers import V_ON_GLOO, assert_close_losses, launch_script, needs_v
from support.sgd_model import CLIP, STEPS, PreClipNorms, train
from torch import nn

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import HostSyncCounter, RunSummary
from dynmo_lightning.callbacks.syncs import counting_dispatch
from dynmo_lightning.pipeline.stage.reduce import GlobalNormClipping
from dynmo_lightning.pipeline.topology.world import FixedWorld
from dynmo_lightning.strategy.precision import PipelinePrecision

SCRIPT = SUPPORT / "_sgd_script.py"
#: P = 2 x D = 2 (a replica's batch of 8: the global batch of 16 of the reference) and P = 2 x T = 2, in one launch.
FOUR = {
    "ddp": "dp=2,mode=ddp,batch=8",
    "fsdp": "dp=2,mode=fsdp,batch=8",
    "fsdp-lean": "dp=2,mode=fsdp,memory=lean,batch=8",
    "fsdp-auto": "dp=2,mode=fsdp,auto=1,batch=8",
    "replicate": "dp=2,mode=replicate,batch=8",
    "tp2": "tp=2",
    "fsdp-clip": f"dp=2,mode=fsdp,batch=8,clip={CLIP}",
    "tp2-clip": f"tp=2,clip={CLIP}",
}
#: P = 2 ranks x 2 stages, the V (stages 0 and 3 on rank 0).
TWO = {"zbv": "zbv=1"} if V_ON_GLOO else {}


@pytest.fixture(scope="module")
def reference() -> dict[float | None, dict[str, list[float]]]:
    """Plain Lightning on one device, without clipping and with it: losses and pre-clip norms per step."""
    out = {}
    for clip in (None, CLIP):
        norms = PreClipNorms()
        model = train(clip=clip, callbacks=[norms])
        out[clip] = {"losses": model.losses, "norms": norms.norms}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    d = tmp_path_factory.mktemp("scale")
    for world_size, cases in ((4, FOUR), (2, TWO)):
        if cases:  # the V only where it runs (support.helpers.V_ON_GLOO)
            specs = [f"{name}:{spec}" for name, spec in cases.items()]
            launch_script(world_size, SCRIPT, str(d), *specs, log_dir=d / "logs", timeout=480)
    runs = {name: json.loads((d / name / "summary.json").read_text()) for name in [*FOUR, *TWO]}
    runs["fsdp-auto"]["ways"] = json.loads((d / "fsdp-auto" / "ways.json").read_text())
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name", ["ddp", "fsdp", "fsdp-lean", "fsdp-auto", "replicate", "tp2", pytest.param("zbv", marks=needs_v)]
)
def test_sgd_without_clipping_equals_plain_lightning_on_one_device(runs, reference, name):
    summary = runs[name]
    assert summary["steps"] == STEPS and summary["replicas_in_sync"]
    assert summary["grad_norms"] == []  # nothing clipped by norm
    assert_close_losses(summary["losses"], reference[None]["losses"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_balancer_runs_fsdp_lean_while_only_lean_fits_and_fast_again_after(runs):
    """``fsdp_memory="auto"``: the capacity between the two ways' least peaks from step 2 to 5 (``Squeeze``)."""
    ways = runs["fsdp-auto"]["ways"]
    assert ways[:3] == ["fast"] * 3  # until the check at the end of step 2
    assert "lean" in ways[3:7] and ways[-1] == "fast", ways  # lean while only lean fits, fast once it does again


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["fsdp-clip", "tp2-clip"])
def test_the_norm_of_gradients_held_in_parts_equals_one_devices(runs, reference, name):
    summary, ref = runs[name], reference[CLIP]
    assert min(ref["norms"]) > 1.5 * CLIP  # clipping acts at every step: the norm sets every update
    assert len(summary["grad_norms"]) == STEPS
    assert_close_losses(summary["grad_norms"], ref["norms"])
    assert_close_losses(summary["losses"], ref["losses"])


class _Scale(Callback):
    """Multiplies every gradient by ``factor`` before the optimizer step (what a wrong reduction would do)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(self.factor)


@pytest.mark.parametrize("factor", [2.0, 0.5, 1.0 + 1e-3])
def test_these_runs_see_a_wrong_gradient_scale(factor):
    """The reference's own check: a run whose gradients are scaled by ``factor`` is not within the tolerance."""
    exact, scaled = train(), train(callbacks=[_Scale(factor)])  # the model seeds itself
    with pytest.raises(AssertionError, match="step"):
        assert_close_losses(scaled.losses, exact.losses)


# --- the pre-clip norm, in one process ----------------------------------------------------------------------------
def _clipping(model: nn.Module) -> GlobalNormClipping:
    names = dict(model.named_parameters())
    pipe = SimpleNamespace(group=None, control=None, device=torch.device("cpu"))  # one process: the default group
    return GlobalNormClipping(list(names), lambda: {id(p): n for n, p in names.items()}, FixedWorld(pipeline=pipe))


def test_the_clipping_keeps_the_norm_torch_returns(one_process_world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5))
    twin = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(32, 7)
    for m in (model, twin):
        (m(x).square().sum() * 100).backward()
    clip = _clipping(model)
    assert clip.last_norm is None
    clip(torch.optim.SGD(model.parameters(), lr=0.1), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert clip.last_norm is not None and torch.equal(clip.last_norm, expected) and expected > 0.5
    first = clip.last_norm
    for p in model.parameters():  # a stage whose layers have no gradient (frozen): the norm is still known
        p.grad = None
    clip(torch.optim.SGD(model.parameters(), lr=0.1), 0.5)
    assert clip.last_norm is not first and float(clip.last_norm) == 0.0


def test_the_summary_records_each_clipping_once_without_reading_it_in_the_step(tmp_path):
    model = nn.Linear(3, 2)
    plugin = PipelinePrecision(Precision())
    plugin.clip_by_norm = clip = _clipping(model)
    summary, trainer = RunSummary(str(tmp_path)), SimpleNamespace(precision_plugin=plugin)
    first, second = torch.tensor(2.0), torch.tensor(3.0)
    with counting_dispatch() as seen:
        summary._record_grad_norm(trainer)  # nothing clipped yet
        clip.last_norm = first
        summary._record_grad_norm(trainer)
        summary._record_grad_norm(trainer)  # no clipping since: the same tensor
        clip.last_norm = second
        summary._record_grad_norm(trainer)
    assert not seen, seen
    assert summary.grad_norms == [2.0, 3.0]
    plain = RunSummary(str(tmp_path))
    plain._record_grad_norm(SimpleNamespace(precision_plugin=Precision()))  # not a pipeline: nothing recorded
    assert plain.grad_norms == []


@pytest.mark.timeout(300)
def test_one_stage_records_the_norm_one_device_computes_and_reads_nothing_in_the_step(tmp_path):
    plain, norms, counter = PreClipNorms(), PreClipNorms(), HostSyncCounter()
    reference = train(clip=CLIP, callbacks=[plain])
    with counter.patched():
        staged = train(
            DynMoStrategy(n_microbatches=4), clip=CLIP, callbacks=[RunSummary(str(tmp_path)), norms, counter]
        )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grad_norms"] == pytest.approx(norms.norms, rel=1e-6)  # what torch computes from the same grads
    assert_close_losses(summary["grad_norms"], plain.norms)
    assert_close_losses(staged.losses, reference.losses)
    # The test's own callbacks and the user's model read their values (tests/support): nothing of the package does.
    # (the last step's window holds the end of training: the summary is read and written there)
    ours = [site for step in counter.dispatch_sites[2:-1] for site in step if "/dynmo_lightning/" in site]
    assert not ours, ours
