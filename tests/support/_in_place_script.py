"""One rank of a P = 2 x D = 2 job whose rank KILL_RANK is SIGKILLed at step KILL_STEP in PHASE (or never: ``-1``).

``PYTHONPATH=tests python tests/support/_in_place_script.py RUN_DIR DATA_PARALLEL KILL_RANK KILL_STEP PHASE
[REPLICAS [RANK:STEP:PHASE]]`` (a P = 2 x D = REPLICAS job, and a second kill), started
by ``dynmo_lightning.launch.start_ranks`` (the launching process hosts the job's store, as torchrun's agent does).
With ``on_peer_lost="recover"`` the survivors go on. ``PHASE`` ``migration`` adds a balancer that migrates layers
every 3 steps, ``consolidation`` a consolidation onto pipeline rank 0 at KILL_STEP, ``checkpoint`` a sharded
checkpoint every 4 steps, ``after-consolidation`` a consolidation at step 2 and then a kill at a step's start
(none of them changes the math). Every process that finishes writes
``RUN_DIR/rank{r}.json`` (``r``: its rank at start): the loss of every step, the recoveries, its final world size.
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.bench.in_place import ShrinkAt
from dynmo_lightning.bench.kills import KillAt
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

run, data_parallel, kill_rank, kill_step, phase = Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:5]), sys.argv[5]
REPLICAS = int(sys.argv[6]) if len(sys.argv) > 6 else 2
LATER = sys.argv[7].split(":") if len(sys.argv) > 7 else None  # a second kill: RANK:STEP:PHASE
STEPS = 12
ORIGIN = int(os.environ["LOCAL_RANK"])  # a recovery renumbers the survivors


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])

    def on_train_end(self, trainer, module) -> None:
        control = trainer.strategy.pipeline_control
        record = {"losses": self.losses, "recoveries": control.resizer.in_place.recoveries, "origin": ORIGIN,
                  "world": trainer.world_size, "partitions": control.partitions,
                  "layers": control.local.slots.local_indices()}  # fmt: skip
        (run / f"rank{ORIGIN}.json").write_text(json.dumps(record))


callbacks: list[L.Callback] = [Losses()]
if phase == "after-consolidation":  # a consolidation at step 2, then a step's start killed: a later world's loss
    callbacks += [ShrinkAt(2), KillAt(kill_rank, kill_step, "step", record=run / "faults.jsonl")]
elif kill_step >= 0:
    callbacks.append(KillAt(kill_rank, kill_step, phase, record=run / "faults.jsonl"))
if LATER is not None:
    callbacks.append(KillAt(int(LATER[0]), int(LATER[1]), LATER[2], record=run / "faults.jsonl"))
if phase == "migration":
    callbacks.append(DynMoBalancer(method="random", every_n_steps=3, warmup_steps=0))
elif phase == "consolidation":
    callbacks.append(ShrinkAt(kill_step))
elif phase == "checkpoint":
    callbacks.append(ModelCheckpoint(dirpath=run / "checkpoints", save_top_k=-1, every_n_train_steps=4))
L.seed_everything(0)
strategy = DynMoStrategy(n_microbatches=2, data_parallel_size=REPLICAS, data_parallel=data_parallel,
                         heartbeat_timeout=3.0, timeout=120, on_peer_lost="recover", checkpoint_format="sharded")
trainer = L.Trainer(
    accelerator="cpu",
    devices=2 * REPLICAS,
    strategy=strategy,
    max_steps=STEPS,
    callbacks=callbacks,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=phase == "checkpoint",
    limit_val_batches=0,
)
trainer.fit(
    GPT(n_layer=4, n_embd=32, n_head=4, block_size=32),
    datamodule=StdlibCharDataModule(block_size=32, batch_size=4, max_bytes=60_000),
)
