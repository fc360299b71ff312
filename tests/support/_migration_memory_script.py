"""Six ranks (P = 3 x D = 2 under fsdp or replicate, P = 3 x T = 2 split): the memory of a migration that brings
two layers to one rank from both sides (run by ``tests/pipeline/test_migration_memory.py``).

Usage: ``python tests/support/_migration_memory_script.py OUT MODE [MODE ...]`` (``fsdp``, ``replicate``, ``tp``),
one fit per mode in one launch. After step 3 the split goes from [2, 2, 2] to [1, 4, 1]: pipeline rank 1 receives
layer 1 from rank 0 and layer 4 from rank 2. Every rank writes ``OUT.<mode>.rank<r>.json``: the bytes of its
tensors before the move (parameters, gradients, optimizer state, buffers), the peak while layers travel and
install, the bytes after, and the bytes of the parts that arrived (parameters and optimizer state). Counted by
:class:`dynmo_lightning.bench.allocations.PeakBytes`, which sees DTensors' local tensors.
"""

import gc
import json
import sys

import lightning.pytorch as L
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy, PipelineModule
from dynmo_lightning.bench.allocations import PeakBytes
from dynmo_lightning.launch import fresh_world
from dynmo_lightning.protocol import local_part

WIDTH = 256  # a weight's part (128 x 256 fp32, 128 KiB) travels as a message of its own


class Net(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(6)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, out, y):
        return nn.functional.mse_loss(out, y)

    def pipeline_parallelize_layer(self, index, layer, tp_mesh):
        parallelize_module(layer, tp_mesh, {"0": ColwiseParallel(output_layouts=Replicate())})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def held(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a process holds of ``module``: parameters, gradients, optimizer state, buffers."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [*params, *grads, *state, *module.buffers()]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(local_part(t).untyped_storage().nbytes() for t in tensors)


class Measure(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        strategy, opt = trainer.strategy, trainer.strategy.optimizers[0]
        before_layers = set(strategy.pipeline_control.local.slots.local_indices())
        gc.collect()
        counter = PeakBytes()
        with counter:
            counter.track(held(pl_module, opt))
            before = counter.live
            strategy.pipeline_control.repartition([1, 4, 1])
            gc.collect()
            after = counter.live
        slots = strategy.pipeline_control.local.slots
        arrived = [slots.get(i) for i in slots.local_indices() if i not in before_layers]
        params = [p for layer in arrived for p in layer.parameters()]
        state = [v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        result = {"before": before, "peak": counter.peak, "after": after, "arrived_layers": len(arrived),
                  "arrived_bytes": _bytes([*params, *state]), "held_after": _bytes(held(pl_module, opt)),
                  "pp_rank": strategy.pipeline_control.pp_rank}  # fmt: skip
        with open(f"{self.out}.rank{strategy.global_rank}.json", "w") as f:
            json.dump(result, f)


def main() -> None:
    out, modes = sys.argv[1], sys.argv[2:]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g))
    for mode in modes:
        sizes = {"tensor_parallel_size": 2} if mode == "tp" else {"data_parallel_size": 2, "data_parallel": mode}
        with fresh_world():
            trainer = L.Trainer(
                accelerator="cpu",
                devices=6,
                strategy=DynMoStrategy(partition=[2, 2, 2], n_microbatches=3, heartbeat_timeout=120, **sizes),
                max_steps=4,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[Measure(f"{out}.{mode}")],
            )
            trainer.fit(Net(), DataLoader(data, batch_size=6))


if __name__ == "__main__":
    main()
