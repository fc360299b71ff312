"""Four ranks (P = 4, ``fsdp``, one replica): the memory of a consolidation whose released processes become replicas
(run by ``tests/pipeline/test_elastic_in_parts.py``).

Usage: ``python tests/support/_world_change_memory_script.py OUT``. After step 3 the pipeline [2, 2, 1, 1] of six
layers packs onto pipeline ranks 0 and 1 ([3, 3]); ranks 2 and 3 receive a copy of their layers and the replica
group grows from 1 to 2, every layer re-sharded over it (``pipeline/reshape.rehome``). Every rank writes
``OUT.rank<r>.json``: the bytes of its tensors before (parameters, gradients, optimizer state, buffers) and of its
gradients alone (dropped before layers move), the peak
during the world change, the bytes after, the bytes it received while layers moved, and one layer's bytes with its
AdamW state. Counted by :class:`dynmo_lightning.bench.allocations.PeakBytes`, which sees DTensors' local tensors.
"""

import gc
import json
import sys

import lightning.pytorch as L
import torch
from _migration_memory_script import WIDTH, Net, held  # the same six layers and the same count of what is held
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.bench.allocations import PeakBytes, storage_bytes
from dynmo_lightning.launch import fresh_world


class Measure(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 3:
            return
        strategy, opt = trainer.strategy, trainer.strategy.optimizers[0]
        rank = strategy.global_rank
        gc.collect()
        counter = PeakBytes()
        with counter:
            counter.track(held(pl_module, opt))
            before = counter.live
            grads = storage_bytes([p.grad for p in pl_module.parameters() if p.grad is not None])
            stats = strategy.pipeline_control.shrink([0, 1], [3, 3], on_release="data_parallel")
            gc.collect()
            after = counter.live
        layer = 3 * (WIDTH * WIDTH + WIDTH) * 4  # weights and AdamW's two moments, fp32
        result = {"before": before, "grads": grads, "peak": counter.peak, "after": after,
                  "received": stats.bytes_received, "layer_bytes": layer, "replicas": strategy.pipeline_control.dp_size,
                  "rank_before": rank}  # fmt: skip
        with open(f"{self.out}.rank{rank}.json", "w") as f:
            json.dump(result, f)


def main() -> None:
    out = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g))
    with fresh_world():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=DynMoStrategy(
                partition=[2, 2, 1, 1], n_microbatches=4, data_parallel="fsdp", heartbeat_timeout=120
            ),
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Measure(out)],
        )
        trainer.fit(Net(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
