"""FSDP2's gradient reduction of units that may leave parameters unused, on the torch of the GPU image (2.11) too.

Two replicas under bf16-mixed (2 gloo processes): an expert one replica's tokens never reach gets a zero in the
reduction dtype (FSDP2 accumulates the other gradients in float32 while gradient sync is off, and reduces a unit's
gradients as one buffer of one dtype), also when another expert's only gradient arrived after FSDP2's last
post-backward. In one process: FSDP2's parameter groups read from a state as torch 2.11 has it
(``_fsdp_param_group``, one group) and as newer torch has it (``_fsdp_param_groups``).
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from support import SUPPORT
from support.helpers import launch_script
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dynmo_lightning.core.parts import fsdp_param_groups
from dynmo_lightning.pipeline.parallel import data_parallel as sharding
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.topology.world import FixedWorld


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (types.SimpleNamespace(_fsdp_param_group="g"), ["g"]),  # torch <= 2.11
        (types.SimpleNamespace(_fsdp_param_group=None), []),  # a unit without parameters of its own
        (types.SimpleNamespace(_fsdp_param_groups=["g", "h"]), ["g", "h"]),  # newer torch
    ],
)
def test_fsdp_param_groups_reads_both_torch_layouts(state, expected):
    assert fsdp_param_groups(state) == expected


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def pipeline_unused_parameters(self) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)  # `b` gets its gradient by hand below


@pytest.mark.timeout(60)
def test_a_lone_grad_joins_the_accumulated_ones_on_a_torch_2_11_state(one_process_world, monkeypatch):
    """FSDP2 with gradient sync off (as a pipeline stage runs it), then a `.grad` after its last post-backward."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    shard = StageSharding("fsdp", FixedWorld(mesh), torch.device("cpu"), torch.bfloat16)
    unit = _Unit()
    shard.shard_layers([unit])
    root = shard.wrap(nn.Sequential(unit), None)
    root.set_is_last_backward(False)  # as torch's pipeline stage runs every micro-batch's backward
    root.set_reshard_after_backward(False)
    root.set_requires_gradient_sync(False)
    root(torch.randn(2, 4, requires_grad=True)).sum().backward()
    (group,) = fsdp_param_groups(sharding._state(unit))
    late = next(fp for fp in group.fsdp_params if fp.unsharded_param is unit.b.weight)
    late.unsharded_param.grad = torch.ones_like(late.unsharded_param)  # a late weight pass: bf16, on `.grad`
    real = sharding._state
    monkeypatch.setattr(
        sharding, "_state", lambda m: types.SimpleNamespace(_fsdp_param_group=real(m)._fsdp_param_group)
    )
    shard.fill_unused_grads(root, None)
    dtypes = {
        fp._param_fqn: fp.unsharded_accumulated_grad.dtype
        for fp in group.fsdp_params
        if fp.unsharded_accumulated_grad is not None
    }
    assert dtypes == {"0.a.weight": torch.float32, "0.a.bias": torch.float32, "0.b.weight": torch.float32}
    assert late.unsharded_param.grad is None and torch.equal(late.unsharded_accumulated_grad, torch.ones(4, 4))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_experts_one_replica_did_not_use_reduce_in_the_reduction_dtype(tmp_path):
    """fsdp and replicate, bf16-mixed: the step runs; every averaged gradient is one fp32 process's (bf16 tolerance)."""
    launch_script(2, SUPPORT / "_unused_grads_script.py", str(tmp_path / "out"), log_dir=tmp_path / "logs", timeout=240)
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    for results in ranks:
        for name, result in results.items():
            assert result["error"] is None, f"{name}: {result['error']}"
            # bf16 compute: ~5e-3 here; an expert averaged without the other replica's zero would be off by ~1
            assert max(result["errors"].values()) < 2e-2, (name, result["errors"])
        assert list(results) == ["fsdp.unused", "fsdp.late", "replicate.unused", "replicate.late"]


def test_blocks_tokens_may_skip_tell_ddp_to_look_for_unused_parameters():
    """Early exit: a block may get none of a step's tokens (they exited before it); DDP replicas of a stage holding
    it must look for unused parameters, or the next step fails with "Expected to have finished reduction" (found
    by the composition matrix: early exit and Mixture of Depths under ddp D = 2)."""
    from dynmo_lightning.core.model import may_leave_parameters_unused
    from dynmo_lightning.models.blocks import Block

    assert may_leave_parameters_unused(Block(32, 4, 128, 0.0, True, early_exit=True))
    # Mixture of Depths: at capacity 1 (before its schedule starts) the router gets no gradient
    assert may_leave_parameters_unused(Block(32, 4, 128, 0.0, True, mod_capacity=1.0))
    assert not may_leave_parameters_unused(Block(32, 4, 128, 0.0, True))


def test_a_mixture_of_depths_block_runs_its_backward_whole_under_a_split_backward():
    """Its predictor learns from detached hidden states: torch's input and weight passes give it no gradient (found
    by the composition matrix: Mixture of Depths under ZBV trained the predictor not at all)."""
    from dynmo_lightning.core.model import needs_whole_backward
    from dynmo_lightning.models.blocks import Block

    assert needs_whole_backward(Block(32, 4, 128, 0.0, True, mod_capacity=0.5))
    assert not needs_whole_backward(Block(32, 4, 128, 0.0, True, early_exit=True))
