"""One rank of a 3-rank job that a test kills from outside mid-step, mid-migration or mid-checkpoint-write.

``PYTHONPATH=tests python tests/support/_fault_script.py MODE MARKER RUN_DIR``: the victim (rank 2; rank 0 for
``checkpoint``) reaches the phase, touches MARKER and stalls there until the test SIGKILLs it.
"""

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

mode, marker, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
rank = int(os.environ["LOCAL_RANK"])


def stall() -> None:
    marker.touch()
    time.sleep(600)


if mode == "step" and rank == 2:
    from dynmo_lightning.pipeline.stage import slots as layers
    forward, calls = layers.StageModule.forward, [0]

    def stalling_forward(self, *args):
        calls[0] += 1
        if calls[0] == 12:  # a few steps in, between two micro-batches of a step
            stall()
        return forward(self, *args)

    layers.StageModule.forward = stalling_forward
elif mode == "migration" and rank == 2:
    import types

    from dynmo_lightning.pipeline.stage import migration
    from dynmo_lightning.pipeline.topology import transport
    # Migration's tensors stall (after their header went); the shape probe's, through the same room, do not.
    stalling = types.SimpleNamespace(**vars(transport))
    stalling.send_tensors = stalling.recv_tensors = lambda *a, **k: stall()
    migration.transport = stalling
elif mode == "checkpoint" and rank == 0:
    from lightning.fabric.plugins import TorchCheckpointIO

    save, saves = TorchCheckpointIO.save_checkpoint, [0]

    def slow_save(self, checkpoint, path, storage_options=None):
        saves[0] += 1
        if saves[0] == 3:  # the third checkpoint: half-written when the process dies
            Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
            stall()
        return save(self, checkpoint, path, storage_options)

    TorchCheckpointIO.save_checkpoint = slow_save

callbacks = [ModelCheckpoint(dirpath=run_dir, save_last=True, save_top_k=0, every_n_train_steps=2)]
if mode == "migration":
    callbacks.append(DynMoBalancer(method="random", every_n_steps=3, warmup_steps=0))
trainer = L.Trainer(
    accelerator="cpu",
    devices=3,
    # the checkpoint case kills rank 0 inside its CheckpointIO: the single-file format, written through it
    strategy=DynMoStrategy(n_microbatches=3, heartbeat_timeout=6.0, timeout=300, checkpoint_format="single"),
    max_steps=40,
    callbacks=callbacks,
    logger=False,
    enable_progress_bar=False,
    limit_val_batches=0,
)
trainer.fit(
    GPT(n_layer=4, n_embd=32, n_head=4, block_size=32),
    datamodule=StdlibCharDataModule(block_size=32, batch_size=12, max_bytes=200_000),
)
