"""``pipeline/stage/reshape.py`` in one process: a layer held in parts (an FSDP2 unit over a group of one) stripped
whole, pruned with its AdamW state, and made a unit again; and a parameter two submodules share stays shared through
it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dynmo_lightning.models.blocks import MLP
from dynmo_lightning.pipeline.stage.cut import apply_in_parts
from dynmo_lightning.pipeline.stage.reshape import reshape, whole
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.protocol import local_part

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    dist.destroy_process_group()


def _trained(layer: nn.Module) -> torch.optim.Optimizer:
    """AdamW with a step taken (moments and a step count in its state)."""
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_a_unit_is_pruned_whole_with_its_optimizer_state_and_made_a_unit_again(mesh):
    torch.manual_seed(0)
    plain = MLP(8, 16, 0.0, bias=True)
    unit = MLP(8, 16, 0.0, bias=True)
    unit.load_state_dict(plain.state_dict())
    fully_shard(unit, mesh=mesh)
    expected, optimizer = _trained(plain), _trained(unit)
    keep = torch.tensor([1, 4, 5, 9, 15])
    plain.keep_units(keep, [expected])
    root = nn.ModuleList([unit])
    slots = LayerSlots(root, [unit])
    before = [id(p) for p in optimizer.param_groups[0]["params"]]

    def parts(index: int, layer: nn.Module) -> None:
        fully_shard(layer, mesh=mesh)

    reshape(slots, 0, lambda layer, opts: layer.keep_units(keep, opts), [optimizer], torch.device("cpu"), parts)
    pruned = slots.get(0)
    assert pruned is root[0] and pruned is not unit  # installed in its slot
    params = dict(pruned.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())  # a unit again
    group = optimizer.param_groups[0]["params"]
    assert len(group) == len(before) and all(id(p) not in before for p in group)  # the same places, new params
    assert [p for p in group] == list(pruned.parameters())  # in the layer's order, as before
    for name, p in plain.named_parameters():
        new = params[name]
        assert new.shape == p.shape and torch.equal(local_part(new), p.detach())
        state, want = optimizer.state[new], expected.state[p]
        assert torch.equal(local_part(state["exp_avg"]), want["exp_avg"])  # sliced as the plain layer's
        assert torch.equal(local_part(state["exp_avg_sq"]), want["exp_avg_sq"])
        assert not isinstance(state["step"], DTensor) and float(state["step"]) == 1.0  # the count stays a count
    with whole(pruned, torch.device("cpu")) as read:  # read whole: a plain copy
        assert not any(isinstance(p, DTensor) for p in read.parameters())
        assert torch.equal(read.fc.weight, plain.fc.weight.detach())


def test_a_parameter_two_submodules_share_stays_shared_when_made_parts():
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    layer[1].weight = layer[0].weight
    weight = layer[0].weight.detach().clone()
    apply_in_parts(0, layer, torch.device("cpu"), lambda index, module: None)
    assert layer[1].weight is layer[0].weight and torch.equal(layer[0].weight, weight)
