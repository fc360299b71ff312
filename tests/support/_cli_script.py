"""One rank of a LightningCLI job: the user's model and loader (``support.user_model``), configured by YAML.

Usage: ``python tests/support/_cli_script.py CONFIG OUT`` with the distributed environment set. The YAML builds the
Trainer's strategy and callbacks as LightningCLI users write them (``class_path`` + ``init_args``, or
``strategy: dynmo``); global rank 0 writes the losses and the built components' settings to ``OUT`` (JSON).
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI

import dynmo_lightning  # noqa: F401  (registers strategy: dynmo; a class_path imports it itself)
from support.user_model import UserNet, loader


class UserData(L.LightningDataModule):
    def train_dataloader(self):
        return loader()


def main() -> None:
    config, out = sys.argv[1], Path(sys.argv[2])
    cli = LightningCLI(UserNet, UserData, args=["fit", "--config", config], save_config_callback=None)
    trainer = cli.trainer
    if trainer.is_global_zero:
        built = [type(trainer.strategy).__name__, *(type(c).__name__ for c in trainer.callbacks)]
        settings = {type(c).__name__: vars(c.settings) for c in [trainer.strategy, *trainer.callbacks]
                    if hasattr(c, "settings")}  # fmt: skip
        out.write_text(json.dumps({"losses": cli.model.losses, "built": built, "settings": settings}, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
