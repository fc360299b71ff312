"""One rank of a launched job: which console lines about ``weights_only`` a resumed fit under DynMoStrategy prints.

Usage: ``PYTHONPATH=tests python tests/support/_weights_only_script.py OUT_DIR FORMAT`` (``sharded`` or ``single``)
with the distributed environment set. A fit writes a checkpoint (``ModelCheckpoint``); a fresh Trainer resumes from
it (``ckpt_path``); then ``trainer.save_checkpoint`` runs without and with ``weights_only``. Every rank writes
``OUT_DIR/FORMAT.rank<r>.json``: the lines Lightning logged and the warnings raised in each phase.
"""

import json
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy
from support._summary_script import ReadmeNet


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def captured(phases: dict, name: str):
    """Lightning's log lines and every warning raised inside, recorded as ``phases[name]``."""
    handler = _Lines()
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    phases[name] = {"log": handler.lines, "warnings": [str(w.message) for w in caught]}


def _trainer(world_size: int, fmt: str, steps: int, ckpt_dir: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DynMoStrategy(n_microbatches=4, timeout=60, checkpoint_format=fmt),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
    )


def main() -> None:
    out, fmt = Path(sys.argv[1]), sys.argv[2]
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g)), 32)
    ckpt_dir = out / fmt
    phases: dict = {}
    with captured(phases, "fit"):
        _trainer(world_size, fmt, 2, ckpt_dir).fit(ReadmeNet(), loader)
    (saved,) = ckpt_dir.glob("*.ckpt")
    trainer = _trainer(world_size, fmt, 4, ckpt_dir)
    with captured(phases, "resumed fit"):
        trainer.fit(ReadmeNet(), loader, ckpt_path=saved)
    with captured(phases, "save_checkpoint(path)"):
        trainer.save_checkpoint(out / f"{fmt}-default.ckpt")
    with captured(phases, "save_checkpoint(path, weights_only=False)"):
        trainer.save_checkpoint(out / f"{fmt}-full.ckpt", weights_only=False)
    phases["resumed_from_step"] = int(saved.stem.split("step=")[-1])
    phases["global_step"] = trainer.global_step
    (out / f"{fmt}.rank{trainer.global_rank}.json").write_text(json.dumps(phases))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
