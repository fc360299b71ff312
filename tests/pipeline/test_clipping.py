"""Global-norm clipping across stages: one tensor all-reduce, bit-identical to torch's clip_grad_norm_."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dynmo_lightning.pipeline.groups import open_store
from dynmo_lightning.pipeline.reduce import GlobalNormClipping


@pytest.fixture
def one_process_world():
    store = open_store("127.0.0.1", timedelta(seconds=30), world_size=1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
    clip = GlobalNormClipping(
        list(names), lambda: {id(p): n for n, p in names.items()}, lambda: SimpleNamespace(group=None)
    )
    calls = []
    reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("no pickled gather per step"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(t.shape) or reduce(t, *a, **k))
    clip(optimizer, 0.5)
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert calls == [torch.Size([2, 2 * len(names)])]  # one tensor: norms and presence, every group's slots
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
