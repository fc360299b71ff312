"""Two ranks: global unstructured pruning's threshold from weights sharded (FSDP2-like) or replicated (DDP-like).

Run by ``tests/callbacks/test_pruning_threshold.py``: ``python tests/support/_pruning_script.py OUT``; every rank
writes ``OUT.rank<r>.json`` with the threshold it found for each layout and fraction, the bytes its collectives
received, and (sharded) the zeros its local shards got from ``GradualPruning``.
"""

import json
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dynmo_lightning.callbacks import GradualPruning
from dynmo_lightning.callbacks.pruning import global_magnitude_threshold
from dynmo_lightning.protocol import local_part

FRACTIONS = (0.1, 0.5, 0.77)


def weights() -> list[torch.Tensor]:
    """The same random weights on every rank (distinct values)."""
    torch.manual_seed(0)
    return [torch.randn(64, 48), torch.randn(32, 64), torch.randn(16, 32)]


class Received:
    """Bytes this process's collectives received (patched into torch.distributed)."""

    def __init__(self) -> None:
        self.bytes = 0
        reduce, gather = dist.all_reduce, dist.all_gather_object

        def all_reduce(tensor, *args, **kwargs):
            self.bytes += tensor.nbytes
            return reduce(tensor, *args, **kwargs)

        def all_gather_object(out, obj, *args, **kwargs):
            self.bytes += len(pickle.dumps(obj)) * len(out)
            return gather(out, obj, *args, **kwargs)

        dist.all_reduce, dist.all_gather_object = all_reduce, all_gather_object


class Stages(nn.Module):
    """A stand-in of a LightningModule: pipeline ``layers`` (the last, the output layer, is never pruned), the CPU."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.trainer = None

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def sharded_layers(mesh) -> list[nn.Module]:
    """Layers of :func:`weights` whose weights are DTensors sharded over ``mesh`` (FSDP2's layout)."""
    layers = [nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights()]
    for layer, w in zip(layers, weights(), strict=True):
        layer.weight = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    return layers


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    received = Received()
    sharded = [local_part(distribute_tensor(w, mesh, [Shard(0)])) for w in weights()]
    result = {
        "sharded": [float(global_magnitude_threshold(sharded, f, torch.device("cpu"))) for f in FRACTIONS],
        "replicated": [float(global_magnitude_threshold(weights(), f, torch.device("cpu"))) for f in FRACTIONS],
        "received_per_threshold": received.bytes / (2 * len(FRACTIONS)),
    }
    module = Stages(sharded_layers(mesh))
    GradualPruning(mode="unstructured")._prune_weights(module, 0.5, [])
    result["zeros"] = [int((local_part(layer.weight) == 0).sum()) for layer in module.layers]
    result["elements"] = [local_part(layer.weight).numel() for layer in module.layers]
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
