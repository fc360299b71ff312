"""Two ranks: migrate layers mid-training and check that everything defining a layer arrived (run by a test)."""

import gc
import json
import sys
import weakref

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy, PipelineModule


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
        self.layers = nn.ModuleList([nn.Linear(8, 16), Tagged(16, 16), Tagged(16, 16), nn.Linear(16, 4)])

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
    for i in strategy._stages.slots.local_indices():
        summary[i] = {
            n: (float(opt.state[p]["exp_avg"].sum()), group_of[id(p)])
            for n, p in strategy._stages.slots.get(i).named_parameters()
            if id(p) in group_of
        }
    return summary


def _param_refs(strategy, layers) -> list:
    return [weakref.ref(p) for i in layers for p in strategy._stages.slots.get(i).parameters()]


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
        stats = strategy.repartition([1, 3])
        gc.collect()
        local = strategy._stages.slots.local_indices()
        result = {"rank": rank, "moves": [m.layers for m in stats.moves], "local": local}
        if rank == 0:
            result["freed"] = all(r() is None for r in refs)
            result["n_params"] = sum(1 for _ in pl_module.parameters())
            result["opt_params"] = sum(len(g["params"]) for g in opt.param_groups)
        else:
            checks = {}
            for i in (1, 2):
                layer = strategy._stages.slots.get(i)
                assert isinstance(layer, Tagged) and layer.note == {"threshold": 0.25, "hits": [1, 2, 3]}
                assert torch.equal(layer.mask, torch.arange(16, dtype=torch.float32))
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
    assert trainer.strategy.layers_per_stage == [1, 3]


if __name__ == "__main__":
    main()
