"""Two replicas of one stage under FSDP2 bf16-mixed, an expert that one replica's tokens never reach (run by
``tests/pipeline/test_unused_grads.py``).

Usage: ``python tests/support/_unused_grads_script.py OUT``; every mode (``fsdp``, ``replicate``) and case in turn:

- ``unused``: the second expert gets no token of replica 1 (no gradient there) and tokens of replica 0 in every
  micro-batch, whose gradient FSDP2 accumulates in float32 (``unsharded_accumulated_grad``: gradient sync is off
  until the last micro-batch, as torch's pipeline stage runs it).
- ``late``: as ``unused``, and on replica 0 the second expert's gradient arrives only after FSDP2's last
  post-backward, in the compute dtype on ``.grad`` (what a split backward's last weight pass leaves), while the
  other parameters of its unit accumulated in float32.

The stage runs as the runtime runs one (``_Stage``: a GPipe schedule of 2 micro-batches, the zero fill before the
reduction). Every rank writes ``OUT.rank<r>.json``, by ``"<mode>.<case>"``: ``error`` (``None`` when the step ran;
after a failure the world is broken and the later cases are not run) and, per parameter, the largest difference
between its averaged gradient and one float32 process's gradient of the loss over both replicas' data, relative to
that gradient's largest element.
"""

import json
import os
import sys
import traceback
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import ScheduleGPipe

from dynmo_lightning.core.parts import fsdp_param_groups
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding, _state
from dynmo_lightning.pipeline.stage.torch_stage import _Stage
from dynmo_lightning.pipeline.topology.world import FixedWorld

WIDTH, N_MICRO, ROWS = 16, 2, 8


class Experts(nn.Module):
    """Two experts run one by one: a token goes to the second only if its first feature is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def pipeline_unused_parameters(self) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        routed = x[:, 0] > 0
        if routed.any():  # expert by expert: an expert no token reached is not run at all
            y = y.index_add(0, routed.nonzero().squeeze(1), self.second(x[routed]))
        return y


class Dense(nn.Module):
    """``x + tanh(W x + b)``: a token's first feature keeps its sign when it is large (its route is its replica's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    # a dense layer first: the experts' inputs carry gradients, so FSDP2's post-backward runs after each micro-batch
    return [Dense(), Experts()]


def data(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica 0's tokens reach both experts in each micro-batch; replica 1's reach the first only."""
    g = torch.Generator().manual_seed(replica)
    x = torch.randn(N_MICRO * ROWS, WIDTH, generator=g)
    y = torch.randn(N_MICRO * ROWS, WIDTH, generator=g)
    x[:, 0] = 4.0 if replica == 0 else -4.0
    return x, y


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # in float32: torch 2.11's mse_loss backward refuses a bf16 output beside a float32 target
    return nn.functional.mse_loss(output.float(), target)


def reference() -> dict[str, torch.Tensor]:
    """One float32 process: the gradient of the mean loss over every micro-batch of both replicas."""
    model = nn.Sequential(*layers())
    losses = []
    for replica in (0, 1):
        x, y = data(replica)
        for xs, ys in zip(x.chunk(N_MICRO), y.chunk(N_MICRO), strict=True):
            losses.append(nn.functional.mse_loss(model(xs), ys))
    torch.stack(losses).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


class LateStage(_Stage):
    """A stage whose second expert's gradient on replica 0 arrives after FSDP2's last post-backward."""

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        expert = self.submod[1]
        for group in fsdp_param_groups(_state(expert)):
            for fp in group.fsdp_params:
                if fp.unsharded_param is not expert.second.weight and fp.unsharded_param is not expert.second.bias:
                    continue
                assert fp.unsharded_accumulated_grad.dtype == torch.float32  # accumulated over both micro-batches
                # what a late weight pass leaves: the compute dtype on .grad, nothing accumulated
                fp.unsharded_param.grad = fp.unsharded_accumulated_grad.to(torch.bfloat16)
                fp.unsharded_accumulated_grad = None
        super().perform_reduce_grad(grad_scale_factor)


def run(mode: str, case: str, rank: int) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    cpu = torch.device("cpu")
    sharding = StageSharding(mode, FixedWorld(mesh), cpu, torch.bfloat16)
    local = layers()
    sharding.shard_layers(local)
    module = sharding.wrap(nn.Sequential(*local), None)
    own = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    profiler = types.SimpleNamespace()  # only a split backward's weight pass asks it for a timer
    cls = LateStage if case == "late" and rank == 0 else _Stage
    runtime = types.SimpleNamespace(replicas_host=dist.group.WORLD)  # what a stage reads of its runtime
    stage = cls(profiler, runtime, sharding, module, 0, 1, cpu, group=own)
    schedule = ScheduleGPipe(stage, N_MICRO, loss_fn=loss)
    x, y = data(rank)
    try:
        schedule.step(x, target=y)
    except Exception:
        return {"error": traceback.format_exc()}
    ref = reference()
    errors = {}
    for name, p in module.named_parameters():
        grad = p.grad.full_tensor()  # collective: both ranks, same order
        errors[name] = float((grad - ref[name]).abs().max() / ref[name].abs().max())
    return {"error": None, "errors": errors}


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a replica that failed leaves the other waiting
    results = {}
    for mode in ("fsdp", "replicate"):
        for case in ("unused", "late"):
            results[f"{mode}.{case}"] = result = run(mode, case, rank)
            if result["error"] is not None:
                break
        else:
            continue
        break
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
