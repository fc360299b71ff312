"""Four ranks (P = 2 x D = 2): what each process holds under ``data_parallel`` ddp, replicate and fsdp, and what one
layer migration allocates (run by ``tests/pipeline/test_sharding.py``); mode ``tp``: P = 2 x T = 2, every hidden
layer split over two processes by the model's own plan (``tests/pipeline/test_tensor_parallel.py``).

Usage: ``python tests/support/_sharding_script.py OUT MODE``; every rank writes ``OUT.<mode>.rank<r>.json`` with the
bytes of parameters, gradients and optimizer state it holds (local shards, just before the step's optimizer step),
and the bytes of every tensor allocated while layer 2 migrates from pipeline rank 0 to 1, beside the moved layer's
whole size.
"""

import json
import sys

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy, PipelineModule
from dynmo_lightning.bench.allocations import storages
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.protocol import local_part

WIDTH = 256


class Net(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4)])
        self.layers.append(nn.Linear(WIDTH, 8))

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, out, y):
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SplitNet(Net):
    """The same layers, each hidden one split by rows over the tensor-parallel group (its output gathered whole)."""

    def pipeline_parallelize_layer(self, index, layer, tp_mesh):
        if isinstance(layer, nn.Sequential):
            parallelize_module(layer, tp_mesh, {"0": ColwiseParallel(output_layouts=Replicate())})


class Allocations(TorchDispatchMode):
    """Counts the bytes of every new storage an operation returns (meta tensors and views are not new memory).

    A DTensor's operation reaches the mode as the DTensor's: its local tensor's storage is counted (``storages``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {s.data_ptr() for s in storages((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for storage in storages(out):
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        return out


def _bytes(tensors) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


class Measure(L.Callback):
    def __init__(self, out: str) -> None:
        self.out, self.result = out, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 2:
            return
        params = [p for p in pl_module.parameters()]
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        self.result["held"] = {
            "params": _bytes(params),
            "grads": _bytes([p.grad for p in params if p.grad is not None]),
            "optim": _bytes(state),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        strategy = trainer.strategy
        opt = strategy.optimizers[0]
        whole = 0
        if strategy.pipeline_control.pp_rank == 0:  # layer 2 leaves pipeline rank 0: its whole size (global shapes)
            params = list(strategy.pipeline_control.local.slots.get(2).parameters())
            state = [v for p in params for v in opt.state[p].values() if v.dim() > 0]
            whole = sum(t.numel() * t.element_size() for t in (*params, *state))
        counter, agree = Allocations(), transport.all_agree
        at_commit = {}

        def commit(ok, group):
            at_commit["bytes"] = counter.bytes
            return agree(ok, group)

        transport.all_agree = commit
        try:
            with counter:
                strategy.pipeline_control.repartition([2, 3])
        finally:
            transport.all_agree = agree
        moved = [0] * dist.get_world_size()
        dist.all_gather_object(moved, whole)
        self.result["migration"] = {"allocated": at_commit["bytes"], "layer_bytes": max(moved)}
        self.result["rank"] = strategy.global_rank
        with open(f"{self.out}.rank{strategy.global_rank}.json", "w") as f:
            json.dump(self.result, f)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, WIDTH, generator=g), torch.randn(256, 8, generator=g))
    split = mode == "tp"
    sizes = {"tensor_parallel_size": 2} if split else {"data_parallel_size": 2, "data_parallel": mode}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=DynMoStrategy(partition=[3, 2], n_microbatches=2, **sizes),
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Measure(f"{out}.{mode}")],
    )
    trainer.fit(SplitNet() if split else Net(), DataLoader(data, batch_size=8))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
