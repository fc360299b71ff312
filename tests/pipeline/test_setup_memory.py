"""Set-up builds a stage as its parts: under fsdp no process holds more than its shards plus one whole layer.

P = 2 x D = 2, the reference GPT at 16 x 1024 (a stage of 8 blocks, ~400 MB fp32), built on the meta device. Each
process's peak resident memory up to the end of set-up, above what it held before the Trainer, measured by the
kernel (``ResidentPeak``: ``VmHWM``, with glibc serving large blocks from their own mappings, so a freed block
leaves the resident set at once, as on a device): under ddp a process holds its stage whole; under fsdp half of it
plus one layer whole on the host (~0.62 of ddp's). Before set-up was shard-first, fsdp peaked above ddp (every
layer materialised whole, then sharded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.helpers import launch_script

from dynmo_lightning.bench.allocations import ResidentPeak

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_set_up_peaks_at_its_shards_plus_one_layer(tmp_path: Path) -> None:
    launch_script(4, SUPPORT / "_setup_memory_script.py", str(tmp_path / "out"), "16", "1024", "ddp", "fsdp",
                  log_dir=tmp_path / "logs")  # fmt: skip
    read = lambda m, r: json.loads((tmp_path / f"out.{m}.rank{r}.json").read_text())  # noqa: E731
    runs = {m: [read(m, r) for r in range(4)] for m in ("ddp", "fsdp")}
    for ddp, fsdp in zip(runs["ddp"], runs["fsdp"], strict=True):
        assert ddp["stage_bytes"] > 380e6 and fsdp["stage_bytes"] == pytest.approx(ddp["stage_bytes"] / 2, rel=0.01)
        ddp_peak, fsdp_peak = ddp["peak"], fsdp["peak"]
        assert ddp_peak >= ddp["stage_bytes"]  # the measure sees the stage
        assert fsdp_peak <= 0.7 * ddp_peak, (fsdp_peak / ddp_peak, fsdp, ddp)
        assert fsdp_peak <= fsdp["stage_bytes"] + 1.5 * fsdp["layer_bytes"] + 0.05 * ddp_peak


def test_the_resident_peak_sees_a_freed_tensor() -> None:
    """The kernel's high-water mark, reset by the process itself, sees 64 MiB allocated and freed in the block."""
    with ResidentPeak() as peak:
        block = torch.ones(16 * 2**20)  # written: resident
        del block
    assert 60 * 2**20 <= peak.peak < 80 * 2**20  # 64 MiB, give or take the pages the interpreter moved
    with ResidentPeak() as again:  # freed at once: the next block starts from where the first began
        pass
    assert again.peak < 8 * 2**20
