"""Recovery without restart (``on_peer_lost="recover"``): P = 2 x D = 2, one process SIGKILLed in each phase.

The survivors finish the run in the same processes, without reading a checkpoint; the intact replica's processes go
on (the broken replica's other process leaves with status 0), and every loss of the run equals the uninterrupted
job's (fp32, rel <= 1e-5): the interrupted step is re-run from its beginning and the intact replica takes over the
lost replica's data, so every step trains on the same global batch. Under FSDP2 a lost process's shards come from
the copies its replica peers keep; a loss after the optimizer update but before those copies were exchanged sends
every survivor back to its own copy of the state before the step (the ``copies`` phase). Migrations and
consolidations that a loss interrupts leave every layer on exactly one survivor of each pipeline.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from support import SUPPORT

from dynmo_lightning.launch import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SCRIPT = SUPPORT / "_in_place_script.py"
N_LAYERS = 4  # the script's GPT(n_layer=4): pipeline layers = embedding, 4 blocks, head
STEPS = 12


def _run(
    tmp: Path, data_parallel: str, victim: int, step: int, phase: str, replicas: int = 2, *later: str
) -> tuple[list[int | None], dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(SCRIPT), str(tmp), data_parallel, str(victim), str(step), phase, str(replicas), *later]
    codes = run_ranks(2 * replicas, argv, log_dir=tmp, tag="job", timeout=400)
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp.glob("rank*.json")}
    return codes, records


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict[int, float]]:
    """The losses of the job that loses nothing, per data-parallel mode (rank 0's)."""
    out = {}
    for mode in ("ddp", "replicate", "fsdp"):
        codes, records = _run(tmp_path_factory.mktemp(f"base-{mode}"), mode, -1, -1, "none")
        assert codes == [0, 0, 0, 0], codes
        out[mode] = {int(k): v for k, v in records[0]["losses"].items()}
    return out


CASES = [
    ("ddp", 3, 5, "forward"),
    ("ddp", 2, 4, "backward"),
    ("ddp", 1, 7, "optimizer"),
    ("ddp", 0, 3, "step"),  # rank 0: the stores the survivors meet at are not its
    ("ddp", 1, 8, "checkpoint"),
    ("ddp", 3, 2, "migration"),
    ("ddp", 3, 5, "consolidation"),
    ("replicate", 0, 6, "backward"),
    ("replicate", 3, 8, "optimizer"),
    ("replicate", 1, 5, "consolidation"),
    ("ddp", 2, 6, "after-consolidation"),  # the world a consolidation made loses a process: its own keys, beats
    # FSDP2: the lost shards come from the copies the replica peers keep (pipeline/elastic/mirror.py)
    ("fsdp", 3, 5, "forward"),
    ("fsdp", 2, 4, "backward"),
    ("fsdp", 1, 7, "optimizer"),
    ("fsdp", 0, 3, "step"),
    ("fsdp", 1, 8, "checkpoint"),
    ("fsdp", 3, 5, "copies"),  # the step applied, its copies not exchanged: every survivor goes back to its own
    ("fsdp", 0, 6, "copies"),
    ("fsdp", 3, 2, "migration"),
    ("fsdp", 3, 5, "consolidation"),
]


@pytest.mark.parametrize(("mode", "victim", "step", "phase"), CASES, ids=[f"{m}-rank{v}-{p}" for m, v, _, p in CASES])
def test_the_survivors_go_on_in_place_and_lose_nothing(tmp_path, uninterrupted, mode, victim, step, phase):
    codes, records = _run(tmp_path, mode, victim, step, phase)
    assert codes[victim] == -signal.SIGKILL, codes
    assert all(code == 0 for r, code in enumerate(codes) if r != victim), codes  # no failure, no restart
    intact = [0, 1] if victim in (2, 3) else [2, 3]
    # after a committed consolidation onto pipeline rank 0 only that rank of the intact replica goes on; under FSDP2
    # every pipeline commits its moves or none does (the copies of moved shards would be on the wrong processes)
    packed = phase == "after-consolidation" or (phase == "consolidation" and mode != "fsdp")
    members = intact[:1] if packed else intact
    assert sorted(records) == members, f"finished: {sorted(records)}"
    for r in members:
        record = records[r]
        assert [rec["lost"] for rec in record["recoveries"]] == [[victim]]
        assert record["recoveries"][0]["members"] == members
        assert record["world"] == len(members)
        losses = {int(k): v for k, v in record["losses"].items()}
        assert sorted(losses) == list(range(STEPS))  # every step ran, the interrupted one again
        for s, loss in losses.items():
            expected = uninterrupted[mode][s]
            assert abs(loss - expected) <= 1e-5 * abs(expected), (s, loss, expected)
    # every layer of the model on exactly one member (the two-phase moves lost nothing, duplicated nothing)
    held = sorted(i for r in members for i in records[r]["layers"])
    assert held == list(range(N_LAYERS + 2)), held
    if phase == "checkpoint":  # the checkpoint the loss interrupted was written by the survivors
        assert (tmp_path / "checkpoints" / "epoch=0-step=8.ckpt").is_dir()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_losses_one_after_the_other_shift_the_data_to_the_replicas_left(tmp_path, mode):
    """P = 2 x D = 3: a loss leaves two replicas for three shards (one takes two, the losses weighted by share); a
    second loss, in the replica that took the extra shard, leaves one replica with all three. Every loss equals the
    job that lost nothing. Under FSDP2 the second loss's shards come from the copies exchanged in the second world."""
    codes, base = _run(tmp_path / "base", mode, -1, -1, "none", 3)
    assert codes == [0] * 6, codes
    expected = {int(k): v for k, v in base[0]["losses"].items()}
    codes, records = _run(tmp_path / "run", mode, 5, 3, "forward", 3, "0:7:backward")
    assert codes[5] == -signal.SIGKILL and codes[0] == -signal.SIGKILL, codes
    assert all(code == 0 for r, code in enumerate(codes) if r not in (0, 5)), codes
    assert sorted(records) == [2, 3]
    for record in records.values():
        assert [(r["step"], r["lost"]) for r in record["recoveries"]] == [(3, [5]), (7, [0])]
        assert record["world"] == 2
        losses = {int(k): v for k, v in record["losses"].items()}
        assert sorted(losses) == list(range(STEPS))
        for s, loss in losses.items():
            assert abs(loss - expected[s]) <= 1e-5 * abs(expected[s]), (s, loss, expected[s])
