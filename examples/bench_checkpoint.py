"""Checkpoint save and load: sharded (every stage writes its own layers) against one file gathered on rank 0.

Run (4 pipeline ranks; a GPT of ~100M parameters, ~1.2 GB with Adam's state):
    torchrun --standalone --nproc_per_node=4 examples/bench_checkpoint.py --out docs/bench/bench_checkpoint.json

After one training step (so that the optimizer has state), the same trainer saves alternately in each format
(``--repeats`` times each, A B A B) and loads each once; per rank it records the wall time and the peak resident
memory above the level before the call (sampled every 2 ms from ``/proc/self/statm``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch.distributed as dist

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measured(fn: Callable[[], Any]) -> dict[str, float]:
    """Wall time of ``fn()`` and the peak resident memory above the level before it (this rank)."""
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    return {"seconds": seconds, "peak_mb": max(0, max(peak[0], rss()) - base) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_checkpoint.json")
    args = parser.parse_args()
    L.seed_everything(0)
    strategy = DynMoStrategy(n_microbatches=4)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy=strategy,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    model = GPT(n_layer=args.layers, n_embd=args.hidden, n_head=16, block_size=64, tie_embeddings=False)
    trainer.fit(model, datamodule=StdlibCharDataModule(max_bytes=200_000, block_size=64, batch_size=8))
    root = tempfile.mkdtemp(prefix="dynmo-ckpt-") if trainer.is_global_zero else None
    root = strategy.broadcast(root)
    results: dict[str, list[dict[str, float]]] = {"sharded": [], "single": []}
    loads: dict[str, dict[str, float]] = {}
    for repeat in range(args.repeats):
        for fmt in ("sharded", "single"):
            strategy.checkpoint_format = fmt
            path = os.path.join(root, f"{fmt}-{repeat}.ckpt")
            dist.barrier()
            results[fmt].append(measured(lambda path=path: trainer.save_checkpoint(path, weights_only=False)))
    for fmt in ("sharded", "single"):
        path = os.path.join(root, f"{fmt}-0.ckpt")
        dist.barrier()

        def load(path: str = path) -> None:
            checkpoint = strategy.load_checkpoint(path)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)

        loads[fmt] = measured(load)
    mine = {"rank": trainer.global_rank, "save": results, "load": loads}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if trainer.is_global_zero:
        summary = {
            "world_size": len(gathered),
            "model": {"n_layer": args.layers, "n_embd": args.hidden},
            "total_params": sum(strategy.pipeline_control.layer_param_counts),
            "layers_per_stage": strategy.pipeline_control.layers_per_stage,
            "ranks": [
                {
                    "rank": g["rank"],
                    **{f"save_{f}_s": statistics.median(r["seconds"] for r in g["save"][f]) for f in g["save"]},
                    **{f"save_{f}_peak_mb": max(r["peak_mb"] for r in g["save"][f]) for f in g["save"]},
                    **{f"load_{f}_s": g["load"][f]["seconds"] for f in g["load"]},
                    **{f"load_{f}_peak_mb": g["load"][f]["peak_mb"] for f in g["load"]},
                }
                for g in gathered
            ],
        }
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main()
