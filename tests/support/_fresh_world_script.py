"""One rank of a job started from outside that trains twice, each fit in a fresh world (run by a test)."""

import json
import os
import sys

import lightning.pytorch as L
import torch.distributed as dist

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import fresh_world
from dynmo_lightning.models import GPT


class World(L.Callback):
    """The world each fit trains in: its rendezvous port, size and group."""

    def __init__(self) -> None:
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        self.seen.append({"port": os.environ["MASTER_PORT"], "world_size": dist.get_world_size(),
                          "group": id(dist.group.WORLD)})  # fmt: skip


def main(out: str) -> None:
    world = World()
    for _ in range(2):
        with fresh_world():
            L.seed_everything(0)
            trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, strategy=DynMoStrategy(n_microbatches=2),
                                callbacks=[world], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, limit_val_batches=0)  # fmt: skip
            model = GPT(n_layer=2, n_embd=16, n_head=2, block_size=16)
            trainer.fit(model, datamodule=StdlibCharDataModule(block_size=16, batch_size=4, max_bytes=50_000))
        assert not dist.is_initialized()
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"worlds": world.seen, "steps": trainer.global_step}, f)


if __name__ == "__main__":
    main(sys.argv[1])
