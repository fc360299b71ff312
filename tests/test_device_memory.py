"""``memory_capacity="auto"``: what a GPU has for this process when training starts, less the margin.

CPU-only here: CUDA's queries are replaced by stand-ins reporting a device that another process shares.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dynmo_lightning.callbacks.balancer import DynMoBalancer
from dynmo_lightning.profiling import device_memory

GiB = 2**30


@pytest.fixture
def shared_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80 GiB GPU of which 30 GiB are free; this process holds 6 GiB there (tensors and its allocator's cache)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GiB)


def test_a_gpu_has_what_is_free_there_and_what_this_process_holds(shared_gpu: None) -> None:
    assert device_memory(torch.device("cuda", 0)) == 36 * GiB  # not the 80 GiB the device has in all
    assert device_memory(torch.device("cpu")) is None  # the host's memory is not planned


def test_auto_capacity_is_that_less_the_margin(shared_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    control = SimpleNamespace(world_size=1, pp_size=1, stages_per_rank=1, data_parallel="ddp", tensor_parallel_size=1)
    monkeypatch.setattr(DynMoBalancer, "_strategy", lambda self, trainer: control)
    balancer = DynMoBalancer(memory_capacity="auto", memory_margin=0.25)
    balancer.setup(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0))), None, "fit")
    assert balancer.policy.settings.memory_capacity == pytest.approx(27 * GiB)
    on_cpu = DynMoBalancer(memory_capacity="auto")
    on_cpu.setup(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"))), None, "fit")
    assert on_cpu.policy.settings.memory_capacity is None  # no limit on CPU
