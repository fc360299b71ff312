"""Global-norm clipping across stages: one all-reduce of the norms on the device and one of the filled slots on the
host, bit-identical to torch's clip_grad_norm_; in steady state no host-to-device copy and no device read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dynmo_lightning.callbacks.syncs import counting_dispatch
from dynmo_lightning.pipeline.stage.reduce import GlobalNormClipping
from dynmo_lightning.pipeline.topology.world import FixedWorld


def test_clipping_is_bit_identical_to_torch_and_uses_one_tensor_all_reduce(one_process_world, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.LayerNorm(5))
    twin = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.LayerNorm(5))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(32, 7)
    for m in (model, twin):
        (m(x).square().sum() * 100).backward()
    head, tail = list(model.parameters())[:2], list(model.parameters())[2:]
    optimizer = torch.optim.SGD([{"params": head}, {"params": tail, "lr": 0.5}], lr=0.1)
    names = dict(model.named_parameters())
    clip = GlobalNormClipping(list(names), lambda: {id(p): n for n, p in names.items()}, FixedWorld(pipeline=_pipe()))
    calls = []
    reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("no pickled gather per step"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append((t.shape, t.dtype)) or reduce(t, *a, **k))
    clip(optimizer, 0.5)
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    # the norms at every group's slots (on the device), and which slots are filled (host data, int32)
    assert calls == [(torch.Size([2 * len(names)]), torch.float64), (torch.Size([2 * len(names)]), torch.int32)]
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def _pipe(device: str = "cpu") -> SimpleNamespace:
    """A one-process pipeline: the default group for device and host data."""
    return SimpleNamespace(group=None, control=None, device=torch.device(device))


def _model_and_clip(device: str = "cpu"):
    model = nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5))
    names = dict(model.named_parameters())
    clip = GlobalNormClipping(
        list(names),
        lambda: {id(p): n for n, p in names.items()},
        FixedWorld(pipeline=_pipe(device)),
    )
    return model, clip


def test_steady_state_clipping_copies_nothing_from_the_host_and_reads_nothing(one_process_world):
    model, clip = _model_and_clip()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 7)).sum().backward()
    with counting_dispatch() as first:
        clip(optimizer, 0.5)
    assert any("host_data" in k for k in first)  # the layout's index tensors, made once ...
    for _ in range(2):
        with counting_dispatch() as later:
            clip(optimizer, 0.5)
        assert not later, later  # ... and reused: no torch.tensor(list), no boolean-mask index, no .item()
    model[0].weight.grad = None  # a trainable parameter without a gradient this step: the same layout
    with counting_dispatch() as same:
        clip(optimizer, 0.5)
    assert not same, same
    model[0].weight.requires_grad_(False)  # frozen: another layout, made again, once
    with counting_dispatch() as changed:
        clip(optimizer, 0.5)
    assert changed


def test_a_missing_gradient_counts_as_zero_as_in_torch(one_process_world):
    model, clip = _model_and_clip()
    twin, _ = _model_and_clip()
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        (m(torch.randn(4, 7, generator=torch.Generator().manual_seed(1))).sum() * 50).backward()
        m[0].bias.grad = None
    clip(torch.optim.SGD(model.parameters(), lr=0.1), 0.5)
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_clipping_keeps_every_tensor_on_the_gradients_device(monkeypatch):
    """Under FakeTensorMode, "cuda" tensors exist without CUDA and mixing them with CPU tensors raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)  # one process: the sum is the tensor itself
    # The filled slots are host data (real NumPy, which fake tensors cannot give): every slot filled once.
    monkeypatch.setattr(GlobalNormClipping, "_copies", lambda self, slots, size, pipe: np.ones(size, dtype=np.int32))
    with FakeTensorMode():
        params = {f"p{i}": nn.Parameter(torch.empty(shape, device="cuda")) for i, shape in enumerate([(13, 7), (5,)])}
        for p in params.values():
            p.grad = torch.empty_like(p)
        ids = {id(p): n for n, p in params.items()}
        clip = GlobalNormClipping(list(params), lambda: ids, FixedWorld(pipeline=_pipe("cuda")))
        clip(torch.optim.SGD(params.values(), lr=0.1), 0.5)
        assert all(p.grad.device.type == "cuda" for p in params.values())


def test_the_precision_wrapper_hands_every_hook_to_the_trainers_plugin_but_clipping_by_norm():
    # A hook Lightning adds to Precision must be seen here: delegated, or kept on purpose (clip_gradients, whose
    # base implementation calls this class's clip_grad_by_norm).
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from dynmo_lightning.strategy.precision import DELEGATED, PipelinePrecision

    hooks = {n for k in Precision.__mro__[:-1] for n, v in vars(k).items() if callable(v) and not n.startswith("_")}
    assert hooks - set(DELEGATED) - set(vars(PipelinePrecision)) == {"clip_gradients"}
    inner = MixedPrecision("bf16-mixed", "cpu")
    plugin = PipelinePrecision(inner)
    calls = []
    inner.state_dict = lambda: calls.append("state_dict") or {"scaler": 1}
    assert plugin.state_dict() == {"scaler": 1} and calls == ["state_dict"]
    with plugin.forward_context():  # the inner plugin's autocast
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with plugin.train_step_context():
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    clipped = []
    plugin.clip_by_norm = lambda optimizer, value: clipped.append(value)
    parameter = nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 10.0)
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    plugin.clip_gradients(optimizer, clip_val=2, gradient_clip_algorithm="norm")
    assert clipped == [2.0]
    plugin.clip_gradients(optimizer, clip_val=0.5, gradient_clip_algorithm="value")
    assert parameter.grad.tolist() == [0.5, 0.5, 0.5]
