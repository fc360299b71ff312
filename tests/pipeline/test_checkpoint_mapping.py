"""A single-file checkpoint is mapped, not read: a process resuming one stage reads only its own layers' tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from dynmo_lightning.bench.allocations import ResidentPeak
from dynmo_lightning.pipeline.checkpoint.safe_load import CheckpointRefused
from dynmo_lightning.pipeline.checkpoint.single_file import AtomicCheckpointIO

MIB = 2**20


def test_resuming_reads_only_the_tensors_it_touches(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    layers = {f"layers.{i}.weight": torch.full((4 * MIB,), float(i)) for i in range(8)}  # 8 x 16 MiB
    torch.save({"state_dict": layers, "global_step": 3}, path)
    io = AtomicCheckpointIO(TorchCheckpointIO())
    with ResidentPeak() as peak:
        checkpoint = io.load_checkpoint(path, weights_only=True)
        mine = checkpoint["state_dict"]["layers.5.weight"].clone()  # one stage's layer: its pages, and the copy
    assert torch.equal(mine, layers["layers.5.weight"]) and checkpoint["global_step"] == 3
    assert peak.peak < 40 * MIB  # not the file's 128 MiB


def test_a_mapped_checkpoint_still_runs_no_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, path)
    with pytest.raises(CheckpointRefused, match="it asks for `print`"):
        AtomicCheckpointIO(TorchCheckpointIO()).load_checkpoint(path, weights_only=True)
    assert "ran" not in capsys.readouterr().out
