"""One rank of a 2-rank job writing sharded checkpoints every 2 steps, in the background or not.

``PYTHONPATH=tests python tests/support/_async_ckpt_script.py RUN_DIR BACKGROUND``. In the background case every
writer's thread is held until the step after the save has ended (its optimizer step changed the weights and the
optimizer state the checkpoint was taken from): a save that did not copy its tensors first would write the later
values, and a save that blocked training would never end (the test's timeout).
"""

import sys
import threading
from pathlib import Path

import lightning.pytorch as L
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

run, background = Path(sys.argv[1]), sys.argv[2] == "1"
EVERY = 2


class HoldWrites(L.Callback):
    """Lets the background write of the checkpoint of step s go only once step s + 1 has ended."""

    def __init__(self) -> None:
        self.released: dict[int, threading.Event] = {}
        write, hold = dcp.FileSystemWriter.write_data, self

        def held_write(writer, plan, planner):
            name = Path(str(writer.path)).name
            step = int(name.split("step=")[1].split(".")[0]) if "step=" in name else -1
            hold.gate(step).wait()
            return write(writer, plan, planner)

        dcp.FileSystemWriter.write_data = held_write

    def gate(self, step: int) -> threading.Event:
        return self.released.setdefault(step, threading.Event())

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        self.gate(trainer.global_step - 1).set()  # step s + 1 ended: its optimizer step is done

    def on_train_end(self, trainer, module) -> None:
        for step in range(trainer.global_step + 1):
            self.gate(step).set()
        self.gate(-1).set()


L.seed_everything(0)
callbacks = [ModelCheckpoint(dirpath=run, save_top_k=-1, every_n_train_steps=EVERY)]
if background:
    callbacks.append(HoldWrites())
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=DynMoStrategy(n_microbatches=2, async_checkpoint=background, checkpoint_format="sharded"),
    max_steps=7,
    callbacks=callbacks,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
)
trainer.fit(
    GPT(n_layer=4, n_embd=32, n_head=4, block_size=32),
    datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000),
)
