"""What a stage holds across steps and moves: DDP's gradients stay in its buckets, moved layers' memory is released.

Before, every step set the gradients to ``None``: autograd then allocated fresh ones for the ``no_sync``
micro-batches beside DDP's buckets (``gradient_as_bucket_view``), and the reducer copied them in at the last one,
so a step held the gradients twice. And after a migration the CUDA caching allocator kept the blocks of the layers
that left.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dynmo_lightning import PipelineModule, profiling
from dynmo_lightning.pipeline.stage import local as stages_module
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.profiling import release_cached_memory
from tests.support.memory import PeakBytes
from tests.support.stages import one_process_stages

pytestmark = pytest.mark.timeout(120)

WIDTH = 256


class _Net(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(6)])
        self.layers.append(nn.Linear(WIDTH, 8))

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)


def _train(replicas: object, steps: int = 4) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Steps as Lightning runs them (schedule, park, zero_grad, restore, optimizer step); each step's peak bytes."""
    model = _Net()
    stages = one_process_stages(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    x, y = torch.randn(16, WIDTH), torch.randn(16, 8)
    peaks = []
    for _ in range(steps):
        with PeakBytes() as memory:
            stages.train(x, y, params, replicas, replicas)
        peaks.append(memory.peak)
        stages.park_grads(params)
        opt.zero_grad()  # Lightning's, between training_step and backward
        stages.restore_grads()
        opt.step()
    return peaks, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ddp_stages_accumulate_every_micro_batch_in_the_buckets(one_process_world):
    grads = sum(p.numel() * 4 for p in _Net().parameters())  # 1.59 MB
    peaks, trained = _train(dist.group.WORLD)
    # Before: 2.0 MB at every step (a fresh gradient of every parameter beside the buckets, and the activations);
    # now 0.46 MB (the activations, one micro-batch's weight gradient before it is added): the buckets take them all.
    assert all(peak < grads / 2 for peak in peaks[2:]), (peaks, grads)  # DDP rebuilds its buckets at step 1
    _, alone = _train(None)  # one replica, no DDP: the same steps
    for name, value in alone.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-6, atol=0)


def test_release_cached_memory_empties_the_cuda_cache_only(monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: calls.append(device) or contextlib.nullcontext())
    release_cached_memory(torch.device("cpu"))
    assert calls == []
    release_cached_memory(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1), "empty"]


def test_released_memory_also_trims_the_host_heap(monkeypatch):
    assert profiling._malloc_trim() is not None  # this machine's C library (glibc) has it
    trims: list[int] = []
    monkeypatch.setattr(profiling, "_malloc_trim", lambda: trims.append)  # malloc_trim(0), recorded
    release_cached_memory(torch.device("cpu"))
    assert trims == [0]
    monkeypatch.setattr(profiling, "_malloc_trim", lambda: None)  # a C library without it: nothing to call
    release_cached_memory(torch.device("cpu"))


def test_migrate_and_pack_release_the_memory_after_the_commit(one_process_world, monkeypatch):
    model = _Net()
    stages = one_process_stages(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    new = StagePlan((7,), 1, "gpipe")
    released: list[tuple[torch.device, bool]] = []
    monkeypatch.setattr(
        stages_module, "release_cached_memory", lambda device: released.append((device, stages.plan is new))
    )
    stages.migrate(new, [opt])
    assert released == [(torch.device("cpu"), True)]  # after the new plan is in force
    stages.pack([0], [7], [], [opt], dist.group.WORLD)
    assert released[1:] == [(torch.device("cpu"), True)]
