"""Every process's peak resident memory during set-up, above the interpreter's own.

Run by ``tests/pipeline/test_setup_memory.py``.

Usage: ``python tests/support/_setup_memory_script.py OUT N_LAYER N_EMBD MODE [MODE ...]``: P = 2 x D = 2 under
``data_parallel=MODE`` (``ddp``, ``fsdp``, ``replicate``), one fit per mode, the reference GPT built on the meta
device; every rank writes ``OUT.<mode>.rank<r>.json`` with its peak resident memory up to the end of set-up above
what it held before the Trainer (the interpreter, torch, Lightning: what is not the model), and the bytes of the
stage it holds (local parts) and of its largest layer whole.

The peak is the kernel's high-water mark of the process's resident set (``VmHWM``), reset before each Trainer
(``dynmo_lightning.bench.allocations.ResidentPeak``, which has glibc serve large blocks from their own mappings:
freed blocks then leave the resident set at once, as a device's memory would, instead of staying in the heap).
"""

import gc
import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.bench.allocations import ResidentPeak, serve_large_blocks_from_mappings
from dynmo_lightning.launch import fresh_world
from dynmo_lightning.models import GPT
from dynmo_lightning.protocol import local_part


class SetupPeak(L.Callback):
    """Writes the peak resident memory up to the end of set-up (``peak`` is open since before the Trainer), and
    stops before the first step."""

    def __init__(self, out: str, peak: ResidentPeak) -> None:
        self.out, self.peak = out, peak

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peak.__exit__(None, None, None)
        stage = sum(local_part(t).numel() * local_part(t).element_size() for t in pl_module.parameters())
        whole = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in pl_module.blocks
                    if any(True for _ in layer.parameters()))  # fmt: skip
        result = {"peak": self.peak.peak, "stage_bytes": stage, "layer_bytes": whole, "rank": trainer.global_rank}
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
        trainer.should_stop = True


def main() -> None:
    out, n_layer, n_embd, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    serve_large_blocks_from_mappings()
    data = torch.utils.data.TensorDataset(torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 16, dtype=torch.long))
    for mode in modes:
        gc.collect()
        peak = ResidentPeak().__enter__()  # the high-water mark from here on, above the resident set now
        model = GPT(n_layer=n_layer, n_embd=n_embd, n_head=8, block_size=16, tie_embeddings=False)
        with fresh_world():
            trainer = L.Trainer(
                accelerator="cpu",
                devices=4,
                strategy=DynMoStrategy(
                    n_microbatches=2, data_parallel_size=2, data_parallel=mode, heartbeat_timeout=120
                ),
                max_steps=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[SetupPeak(f"{out}.{mode}", peak)],
            )
            trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        del model, trainer


if __name__ == "__main__":
    main()
