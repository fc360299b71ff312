"""Fail fast, lose nothing: a process killed mid-step, mid-migration or mid-checkpoint makes every other one exit
non-zero within 60 s with an error naming the lost rank and the phase; the previous checkpoint still loads."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from support import SUPPORT

from dynmo_lightning.launch import start_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = SUPPORT / "_fault_script.py"


def _kill_and_watch(tmp_path: Path, mode: str, victim: int) -> tuple[list[int | None], list[str], float]:
    marker = tmp_path / "reached"
    procs = start_ranks(
        3, [sys.executable, str(SCRIPT), mode, str(marker), str(tmp_path / "ckpt")], log_dir=tmp_path, tag=mode
    )
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert time.monotonic() < deadline, "the victim never reached the phase"
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            time.sleep(0.2)
        time.sleep(0.5)
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        for p in procs:
            p.wait(timeout=120)
        last_exit = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"{mode}.rank{r}.log").read_text() for r in range(3)]
    return [p.returncode for p in procs], logs, last_exit


@pytest.mark.parametrize(("mode", "phase"), [("step", "training step"), ("migration", "layer migration")])
def test_lost_rank_mid_step_or_migration_stops_everyone_fast(tmp_path, mode, phase):
    codes, logs, seconds = _kill_and_watch(tmp_path, mode, victim=2)
    assert codes[2] == -signal.SIGKILL
    assert codes[0] != 0 and codes[1] != 0
    assert seconds < 60, f"survivors took {seconds:.0f} s to stop"
    for log in logs[:2]:
        assert "rank 2 of the job" in log and phase in log, log[-3000:]


def test_kill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path):
    codes, logs, seconds = _kill_and_watch(tmp_path, "checkpoint", victim=0)
    assert codes[1] != 0 and codes[2] != 0 and seconds < 60
    assert any("rank 0" in log for log in logs[1:])
    last = tmp_path / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)  # the complete previous checkpoint
    assert ckpt["global_step"] == 4 and "blocks.0.mlp.fc.weight" in ckpt["state_dict"]
    # the half-written file never took the checkpoint's name
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("last.ckpt.tmp")]
