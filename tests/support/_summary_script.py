"""One rank of a launched job: the model summary of the README's example under DynMoStrategy, before and after a move.

Usage: ``PYTHONPATH=tests python tests/support/_summary_script.py OUT_DIR CASE [CASE ...]`` with the distributed
environment set; a case (:data:`CASES`) is ``rich`` (Lightning's default summary, ``enable_model_summary``),
``tied`` (an explicit plain ``ModelSummary`` and layer 7 sharing layer 0's weight), ``fsdp`` (two replicas of two
stages, each holding half of every layer) or ``shrink`` (a repack onto two ranks, which releases the other two: run
it last). Global rank 0 writes ``OUT_DIR/CASE.json``: the summary callback's class, the summaries
(:func:`~dynmo_lightning.callbacks.pipeline_summary`) and the printed text at fit start and after the case's move.
"""

import dataclasses
import io
import json
import logging
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelSummary
from rich import get_console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy, PipelineModule
from dynmo_lightning.callbacks import pipeline_summary

#: Per case: the strategy's settings, and the split the probe moves to after step 2 (by ``repartition``; ``shrink``:
#: onto the first two ranks).
CASES = {
    "rich": ({}, [1, 1, 1, 5]),
    "tied": ({}, [1, 1, 1, 5]),
    "fsdp": ({"data_parallel_size": 2, "data_parallel": "fsdp"}, [3, 5]),
    "shrink": ({}, [4, 4]),
}


class ReadmeNet(PipelineModule):
    """The README's first example (8 layers of 64, 33.3 K parameters), layer 1 frozen; ``tied``: layer 7's weight
    is layer 0's."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
        self.layers[1].requires_grad_(False)
        if tied:
            self.layers[7][0].weight = self.layers[0][0].weight

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, target):
        return F.mse_loss(output, target)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _summary(trainer, module) -> dict:
    out = dataclasses.asdict(pipeline_summary(trainer, module))
    for row in out["stages"]:
        row["layers"] = list(row["layers"])
    return out


class Probe(L.Callback):
    """Records the summary at the start, moves layers after step 2, and prints the summary again at the end."""

    def __init__(self, case: str, printed) -> None:
        self.case, self.printed = case, printed
        self.result: dict = {}

    def on_train_start(self, trainer, pl_module):
        self.result["fit_start_text"] = self.printed()
        self.result["before"] = _summary(trainer, pl_module)
        self.result["callback"] = [type(c).__name__ for c in trainer.callbacks if isinstance(c, ModelSummary)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            moved = CASES[self.case][1]
            if self.case == "shrink":
                trainer.strategy.pipeline_control.shrink([0, 1], moved)  # ranks 2 and 3 exit (status 0)
            else:
                trainer.strategy.pipeline_control.repartition(moved)

    def on_train_end(self, trainer, pl_module):
        self.result["after"] = _summary(trainer, pl_module)
        (summary,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
        summary.on_fit_start(trainer, pl_module)  # printed again, on the split in force
        self.result["again_text"] = self.printed()


def _printed(case: str):
    """A function returning what the case's summary printed since its last call (rich console or Lightning's log)."""
    if case != "tied":  # Lightning's default summary: the rich one
        console = get_console()
        console.begin_capture()

        def read() -> str:
            text = console.end_capture()
            console.begin_capture()
            return text

        return read
    stream = io.StringIO()
    logging.getLogger("lightning.pytorch.callbacks.model_summary").addHandler(logging.StreamHandler(stream))

    def read() -> str:
        text = stream.getvalue()
        stream.seek(0)
        stream.truncate()
        return text

    return read


def main() -> None:
    out = Path(sys.argv[1])
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for case in sys.argv[2:]:
        probe = Probe(case, _printed(case))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=DynMoStrategy(n_microbatches=4, timeout=60, **CASES[case][0]),
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=[probe] + ([ModelSummary(max_depth=2)] if case == "tied" else []),
        )
        trainer.fit(ReadmeNet(tied=case == "tied"), DataLoader(data, batch_size=32))
        if trainer.is_global_zero:
            (out / f"{case}.json").write_text(json.dumps(probe.result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
