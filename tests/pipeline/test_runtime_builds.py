"""What the runtime keeps between steps: evaluation stages only while an evaluation runs, metadata probed once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime, StagePlan
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup

pytestmark = pytest.mark.timeout(60)


def test_evaluation_stages_are_freed_when_training_resumes_and_rebuilt_without_a_probe(one_process_world, monkeypatch):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 2)])
    runtime = PipelineRuntime(
        LayerSlots(layers, list(layers)),
        StagePlan((2,), 1),
        pipe=PipelineGroup(0, None, [0]),
        device=torch.device("cpu"),
        schedule="gpipe",
        n_microbatches=2,
        loss_fn=lambda out, target: nn.functional.mse_loss(out, target),
    )
    probes: list[bool] = []
    probe = runtime._probe
    monkeypatch.setattr(runtime, "_probe", lambda inputs, train: probes.append(train) or probe(inputs, train))
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    runtime.step(x, y, train=False)
    evaluation = runtime._built[False][0]
    runtime.step(x, y, train=True)
    assert False not in runtime._built  # its receive buffers are not held while training
    loss = runtime.step(x, y, train=False).loss
    assert runtime._built[False][0] is not evaluation and probes == [False, True]  # rebuilt from its metadata
    with torch.no_grad():
        expected = torch.stack(
            [nn.functional.mse_loss(layers[1](layers[0](x[i : i + 2])), y[i : i + 2]) for i in (0, 2)]
        )
    assert torch.equal(loss, expected.mean())

    runtime.invalidate()  # layers changed: probe again
    runtime.step(x, y, train=False)
    assert probes == [False, True, False]


def test_a_missing_input_gradient_a_stage_waits_for_is_sent_as_zeros():
    """torch 2.11 refuses a ``None`` input gradient the previous stage waits for (2.13 skips it on both ends)."""
    from types import SimpleNamespace

    from dynmo_lightning.pipeline.stage.torch_stage import zero_missing_grads

    received = [SimpleNamespace(buffer=torch.ones(2, 3)), SimpleNamespace(buffer=torch.ones(4))]
    grads = zero_missing_grads((None, torch.full((4,), 2.0)), [0, 0], received)
    assert torch.equal(grads[0], torch.zeros(2, 3)) and torch.equal(grads[1], torch.full((4,), 2.0))
    assert zero_missing_grads((None, None), [None, 0], received)[0] is None  # nobody waits: stays None
