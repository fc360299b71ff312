"""Two ranks: migrate layers mid-training and check that everything defining a layer arrived (run by a test).

It also measures the migration's transient memory: the bytes of every tensor allocated while the layers travel
(headers excluded: host data), and whether the sender still held the outgoing layers' gradients then.
"""

import gc
import json
import sys
import weakref

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy, PipelineModule
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.profiling import static_memory

WIDTH = 128  # a 128 x 128 fp32 weight (and its Adam moments) is just large enough to travel as a message of its own


class Tagged(nn.Linear):
    """A layer with dynamic state: a Python attribute, a non-persistent buffer, a frozen parameter."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.note = {"threshold": 0.25, "hits": [1, 2, 3]}
        self.register_buffer("mask", torch.arange(o, dtype=torch.float32), persistent=False)
        self.bias.requires_grad_(False)

    def forward(self, x):
        return super().forward(x) * (self.mask > -1)


class Net(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Linear(8, WIDTH), Tagged(WIDTH, WIDTH), Tagged(WIDTH, WIDTH), nn.Linear(WIDTH, 4)]
        )

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, out, y):
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias") and p.requires_grad]
        return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2)


def _optimizer_summary(strategy, opt) -> dict:
    """Per local layer: {param name: (sum of exp_avg, group index)} of its optimized parameters."""
    group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
    summary = {}
    for i in strategy.pipeline_control.local.slots.local_indices():
        summary[i] = {
            n: (float(opt.state[p]["exp_avg"].sum()), group_of[id(p)])
            for n, p in strategy.pipeline_control.local.slots.get(i).named_parameters()
            if id(p) in group_of
        }
    return summary


def _param_refs(strategy, layers) -> list:
    return [weakref.ref(p) for i in layers for p in strategy.pipeline_control.local.slots.get(i).parameters()]


class Allocations(TorchDispatchMode):
    """Counts the bytes of every new storage an operation returns (views and in-place results are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def _measured_migration(strategy, outgoing: list) -> tuple:
    """Migrate [3, 1] -> [1, 3]; returns the stats, bytes allocated until the commit, and the outgoing grads then."""
    counter, at_commit = Allocations(), {}
    agree, send, recv = transport.all_agree, transport.send_header, transport.recv_header

    def paused(fn):
        def call(*args):
            with _disable_current_modes():
                return fn(*args)

        return call

    def commit(ok, group):
        at_commit["bytes"] = counter.bytes
        at_commit["grads"] = [p.grad is not None for p in outgoing]
        return paused(agree)(ok, group)

    transport.all_agree, transport.send_header, transport.recv_header = commit, paused(send), paused(recv)
    try:
        with counter:
            stats = strategy.pipeline_control.repartition([1, 3])
    finally:
        transport.all_agree, transport.send_header, transport.recv_header = agree, send, recv
    return stats, at_commit


def _payload_bytes(layers, opt) -> tuple[int, int]:
    """Bytes that travel with ``layers`` (parameters, buffers, optimizer state) and those of tensors below the
    coalescing threshold (they also pass through one byte buffer)."""
    tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
    tensors += [v for layer in layers for p in layer.parameters() for v in opt.state.get(p, {}).values()]
    total = sum(static_memory(layer, opt)[0] + static_memory(layer, opt)[2] for layer in layers)
    small = sum(n for t in tensors if (n := t.numel() * t.element_size()) < transport.COALESCE_BELOW)
    return total, small


class Migrate(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        strategy = trainer.strategy
        rank = strategy.global_rank
        opt = strategy.optimizers[0]
        gathered = [None, None]
        dist.all_gather_object(gathered, _optimizer_summary(strategy, opt))
        refs = _param_refs(strategy, (1, 2)) if rank == 0 else []
        outgoing = (
            [p for i in (1, 2) for p in strategy.pipeline_control.local.slots.get(i).parameters()] if rank == 0 else []
        )
        grads_before = [p.grad is not None for p in outgoing]
        if rank == 0:
            sent = _payload_bytes([strategy.pipeline_control.local.slots.get(i) for i in (1, 2)], opt)
        stats, at_commit = _measured_migration(strategy, outgoing)
        del outgoing
        gc.collect()
        local = strategy.pipeline_control.local.slots.local_indices()
        result = {"rank": rank, "moves": [m.layers for m in stats.moves], "local": local}
        result["allocated"] = at_commit["bytes"]
        result["setup_s"], result["seconds"] = stats.setup_seconds, stats.seconds
        if rank == 0:
            result["payload"], result["small"] = sent
            result["grads_before"], result["grads_at_commit"] = grads_before, at_commit["grads"]
            result["freed"] = all(r() is None for r in refs)
            result["n_params"] = sum(1 for _ in pl_module.parameters())
            result["opt_params"] = sum(len(g["params"]) for g in opt.param_groups)
        else:
            checks = {}
            for i in (1, 2):
                layer = strategy.pipeline_control.local.slots.get(i)
                assert isinstance(layer, Tagged) and layer.note == {"threshold": 0.25, "hits": [1, 2, 3]}
                assert torch.equal(layer.mask, torch.arange(WIDTH, dtype=torch.float32))
                assert layer.bias.requires_grad is False and layer.weight.requires_grad is True
                assert pl_module.layers[i] is layer
                for n, p in layer.named_parameters():
                    if n not in gathered[0][i]:
                        assert p not in opt.state  # frozen: never in the optimizer
                        continue
                    exp_sum, group = gathered[0][i][n]
                    assert any(p is q for q in opt.param_groups[group]["params"]), (i, n, group)
                    assert float(opt.state[p]["exp_avg"].sum()) == exp_sum
                    assert int(opt.state[p]["step"]) == 3
                    checks[f"{i}.{n}"] = group
            result["checks"] = checks
            result["payload"], result["small"] = _payload_bytes(
                [strategy.pipeline_control.local.slots.get(i) for i in (1, 2)], opt
            )
        with open(f"{self.out}.rank{rank}.json", "w") as f:
            json.dump(result, f)


def main() -> None:
    out = sys.argv[1]
    x = torch.randn(64, 8)
    y = torch.randn(64, 4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DynMoStrategy(partition=[3, 1], n_microbatches=2),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Migrate(out)],
    )
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.strategy.pipeline_control.layers_per_stage == [1, 3]


if __name__ == "__main__":
    main()
