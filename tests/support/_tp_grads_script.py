"""Two processes of one stage split by tensor parallelism: the gradients of what no plan splits are averaged over them
(run by ``tests/pipeline/test_tp_grads.py``).

Usage: ``python tests/support/_tp_grads_script.py OUT``. Two cases, one after the other:

- ``plain``: an embedding, a linear split by rows (``ColwiseParallel``, its output gathered whole), a norm, and two
  experts, the second of which only rank 0 runs; a third parameter neither runs. Every replicated gradient is then
  made different on the two ranks (what nondeterministic kernels would do, larger), as is the split one.
- ``fsdp``: the same layers as FSDP2 units over a replica mesh of one (``("dp", "tp")`` = ``(1, 2)``): the whole
  parameters are DTensors on ``"dp"`` only, the split one on both.

Then :func:`average_replicated_grads` runs. Every rank writes ``OUT.rank<r>.json``, by case: per parameter, the
local part of its gradient before and after (``None``: no gradient) and the peer's before, as lists; and the host
reads made (``tolist``/``item`` calls and data-dependent operators) in a second call where every parameter has a
gradient here.
"""

import collections
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from dynmo_lightning.callbacks.syncs import counting_dispatch
from dynmo_lightning.core.parts import local_part
from dynmo_lightning.pipeline.parallel.tensor_parallel import TensorParallel, average_replicated_grads
from dynmo_lightning.pipeline.topology.world import FixedWorld


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.never = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        if dist.get_rank() == 0:  # as a token routed differently on one peer would
            y = y + self.second(x)
        return y


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Embedding(16, 8), nn.Sequential(nn.Linear(8, 8)), nn.LayerNorm(8), Experts()]


def split(local: list[nn.Module], mesh) -> None:
    style = ColwiseParallel(output_layouts=Replicate())
    style.src_data_rank = None
    parallelize_module(local[1], mesh, {"0": style})


def grads(local: list[nn.Module]) -> dict[str, list | None]:
    named = [(f"{i}.{n}", p) for i, layer in enumerate(local) for n, p in layer.named_parameters()]
    return {n: None if p.grad is None else local_part(p.grad).tolist() for n, p in named}


def run(case: str, rank: int) -> dict:
    if case == "plain":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    local = layers()
    split(local, tp_mesh)
    if case == "fsdp":
        for layer in local:
            fully_shard(layer, mesh=mesh["dp"])
    tokens = torch.arange(8) % 16
    h = local[0](tokens)
    for layer in local[1:]:
        h = layer(h)
    h.square().sum().backward()
    with torch.no_grad():  # the copies' gradients differ on the two peers, the split one's too
        for layer in local:
            for p in layer.parameters():
                if p.grad is not None:
                    local_part(p.grad).add_(rank + 1)
    before = grads(local)
    peer: list = [None, None]
    dist.all_gather_object(peer, before)
    tp = TensorParallel(nn.Module(), FixedWorld(tp_mesh=tp_mesh))
    average_replicated_grads(local, tp)
    after = grads(local)
    # a second call where every parameter this process trains has a gradient: no host read
    for p in local[3].parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    reads = collections.Counter()
    real = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}
    for name, fn in real.items():
        setattr(torch.Tensor, name, lambda t, *a, _n=name, _f=fn: (reads.update([_n]), _f(t, *a))[1])
    try:
        with counting_dispatch() as ops:
            average_replicated_grads(local, tp)
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
    return {"before": before, "after": after, "peer_before": peer[1 - rank], "reads": dict(reads) | dict(ops)}


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = {case: run(case, rank) for case in ("plain", "fsdp")}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
