"""The pre-launch memory check: a lower bound (the weights as a process holds them at rest), and it says so."""

from __future__ import annotations

import pytest

from dynmo_lightning.callbacks.balancer import DynMoBalancer
from dynmo_lightning.core.control import JobShape


def test_under_fsdp_the_check_counts_shards_and_says_a_step_holds_whole_gradients() -> None:
    job = JobShape(world_size=4, pp_size=2, stages_per_rank=1, layer_param_bytes=[4000, 4000], data_parallel="fsdp")
    DynMoBalancer(memory_capacity=2500).pipeline_check_job(job)  # a shard of the largest layer (2000 bytes) fits
    with pytest.raises(ValueError, match="weights alone are 2,000 bytes") as refused:
        DynMoBalancer(memory_capacity=1500).pipeline_check_job(job)
    assert "fsdp_memory='fast', the default, its stage's gathered weights and whole gradients" in str(refused.value)
    with pytest.raises(ValueError, match="weights alone are 4,000 bytes") as whole:
        DynMoBalancer(memory_capacity=1500).pipeline_check_job(JobShape(4, 2, 1, [4000, 4000], "ddp"))
    assert "fsdp" not in str(whole.value)
