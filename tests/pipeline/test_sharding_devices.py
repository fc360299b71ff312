"""FSDP2 stages on a fake CUDA device: what a GPU would find first (device mixing) found on a CPU.

There is no GPU here: the layers' tensors are fake CUDA tensors (``FakeTensorMode``: mixing one with a CPU tensor
raises), the replica group is torch's fake process group (collectives return at once), and FSDP2's stream and
event handles for "cuda" are CPU ones (``torch.cpu.Stream``, events that are always done). What FSDP2 and the
stages compute is real: sharding on the meta device and materialising on "cuda" (as a migration does on arrival),
the mixed-precision cast to bf16, the all-gather's copy-in and copy-out buffers, and the layers' forward. Forward
only, under ``no_grad``: on this CPU-only torch a backward on fake CUDA tensors aborts the process in the autograd
engine's device guard (as does autograd recording on them), and ``copy_`` between fake CUDA tensors asks the real
CUDA runtime, so a migration's arrival (``StageSharding.adopt``: shard on meta, materialise, copy the received
shards in) is checked here up to the copy, by the same meta-device sharding and materialisation.
"""

from __future__ import annotations

import importlib
import math
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
from torch.distributed import device_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding, is_unit, local
from dynmo_lightning.pipeline.topology.world import FixedWorld
from dynmo_lightning.protocol import run_layers

GPU0 = torch.device("cuda", 0)
_FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")


class _Stream(torch.cpu.Stream):
    """A CUDA stream as FSDP2 uses one, on the CPU (work runs in order: nothing to wait for)."""

    def __new__(cls, *args: object, priority: int = 0, **kwargs: object) -> _Stream:
        return super().__new__(cls)

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


class _Event:
    def record(self, *args: object) -> _Event:
        return self

    def wait(self, *args: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def fake_cuda_world(monkeypatch):
    """A world of 2 (this process is rank 0) on the fake backend, and FSDP2's "cuda" handle on the CPU."""
    handle = types.SimpleNamespace(
        current_device=lambda: 0,
        device_count=lambda: 1,
        Stream=_Stream,
        current_stream=lambda *args: _Stream(),
        stream=torch.cpu.stream,
        Event=_Event,
        synchronize=lambda *args: None,
    )
    real = device_mesh._get_device_handle
    for name in _FSDP_MODULES:
        module = importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")
        monkeypatch.setattr(module, "_get_device_handle", lambda kind: handle if kind == "cuda" else real(kind))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield DeviceMesh("cuda", [0, 1], mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


class _Stage(nn.Module):
    """A stage module as the runtime drives one: its layers in order."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: object) -> object:
        return run_layers(self.layers, x)


def _gpt(**options: object) -> GPT:
    with torch.device("meta"):
        model = GPT(vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16, tie_embeddings=False, **options)
        model.pipeline_layers()
    return model


def _materialise(model: GPT, sharding: StageSharding) -> list[nn.Module]:
    layers = model.pipeline_layers()
    sharding.shard_layers(layers)  # on the meta device: nothing whole is allocated
    for layer in layers:
        layer.to_empty(device=GPU0)  # FSDP2's meta-device initialisation: each process its shards
    return layers


@pytest.mark.timeout(120)
# MoE's grouped path is not here: advanced indexing (``x[index]``) has no fake CUDA kernel in a CPU-only torch
# (it asks the real CUDA runtime); tests/models/test_moe_memory.py covers its CUDA padding.
def test_fsdp_stages_run_a_forward_on_cuda_in_bf16(fake_cuda_world):
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        sharding = StageSharding("fsdp", FixedWorld(fake_cuda_world), GPU0, torch.bfloat16)
        model = _gpt()
        layers = _materialise(model, sharding)
        stage = sharding.wrap(_Stage(layers), None)
        assert all(is_unit(layer) for layer in layers) and is_unit(stage)
        for p in stage.parameters():  # shards, on the device, in float32 (the reduction's and optimizer's dtype)
            assert (local(p).device, local(p).dtype) == (GPU0, torch.float32)
            assert local(p).shape[0] == math.ceil(p.shape[0] / 2)
        ids = torch.zeros(4, 16, dtype=torch.long, device=GPU0)
        out = stage(ids)  # the root all-gathers its layers' parameters
        logits = out[0] if isinstance(out, tuple) else out
        assert (logits.device, logits.dtype, tuple(logits.shape)) == (GPU0, torch.bfloat16, (4, 16, 64))


@pytest.mark.timeout(120)
def test_a_cpu_tensor_inside_a_sharded_layer_is_caught(fake_cuda_world):
    """The control: a layer that makes a CPU tensor in its forward fails here as it would on a GPU."""

    class Mixes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.ones(8)  # on the CPU: the bug this file exists to find

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        sharding = StageSharding("fsdp", FixedWorld(fake_cuda_world), GPU0, None)
        with torch.device("meta"):
            layer = Mixes()
        sharding.shard_layers([layer])
        layer.to_empty(device=GPU0)
        with pytest.raises(FakeTensorDeviceMismatchError):
            layer(torch.empty(2, 8, device=GPU0))
