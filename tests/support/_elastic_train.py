"""dynmo-train with injected layer costs and a probe of every process's view of the world (for launcher tests).

``PYTHONPATH=tests python tests/support/_elastic_train.py OVERRIDES...`` (under torchrun): at the end of training every
process writes ``<run_dir>/world/rank<R>.json`` (its environment, the Trainer's, the module's and torch.distributed's
idea of the world); a process released by a consolidation writes ``released-<old rank>.json`` from the ``on_released``
hook.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import dynmo_lightning.cli as cli
from dynmo_lightning.pipeline.elastic.release import node_name
from support import injected_costs

ENV = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT",
    "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


class WorldProbe(Callback):
    """Writes what this process believes about the world."""

    def __init__(self, run_dir: str) -> None:
        self.dir = Path(run_dir) / "world"

    def _write(self, name: str, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / name).write_text(json.dumps(data, indent=1))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(
            f"rank{trainer.global_rank}.json",
            {
                "env": {k: os.environ.get(k) for k in ENV},
                "trainer": {
                    "world_size": trainer.world_size,
                    "global_rank": trainer.global_rank,
                    "local_rank": trainer.local_rank,
                    "node_rank": trainer.node_rank,
                    "num_nodes": trainer.num_nodes,
                    "is_global_zero": trainer.is_global_zero,
                },
                "module": {"global_rank": pl_module.global_rank, "local_rank": pl_module.local_rank},
                "rank_zero_only": rank_zero_only.rank,
                "dist": {"rank": dist.get_rank(), "world_size": dist.get_world_size()},
                "main_port": trainer.strategy.cluster_environment.main_port,
                "node": node_name(),
                "pid": os.getpid(),
            },
        )

    def on_released(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(f"released-{trainer.global_rank}.json", {"node": node_name(), "step": trainer.global_step})


if __name__ == "__main__":
    injected_costs.inject()
    build = cli.build_callbacks
    cli.build_callbacks = lambda cfg: [*build(cfg), WorldProbe(cfg.run_dir)]  # type: ignore[assignment]
    cli.train()
