"""The recovery benchmark's parts that need no processes: its fault plans, its figures, its page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmo_lightning.bench import in_place, recovery
from dynmo_lightning.bench.kills import STEP_PHASES, KillAt

ROOT = Path(__file__).resolve().parents[2]


def test_a_soak_plan_strikes_once_per_attempt_at_increasing_steps():
    plan = recovery.kill_plan(10, 120, 10, seed=3, ranks=2)
    assert [k["attempt"] for k in plan] == list(range(10))
    steps = [k["step"] for k in plan]
    assert steps == sorted(set(steps)) and 3 <= steps[0] and steps[-1] < 118
    assert all(k["phase"] in STEP_PHASES and k["rank"] in (0, 1) for k in plan)  # the soak's job has no balancer
    assert all(k["step"] % 10 == 0 for k in plan if k["phase"] == "checkpoint")  # only where a checkpoint is written
    assert recovery.kill_plan(10, 120, 10, seed=3, ranks=2) == plan  # the seed decides


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_measure_times_the_recovery_from_the_kill(tmp_path):
    steps = [{"event": "start", "restart": 0, "world": 4, "step": 0, "ckpt": None, "time": 0.0}]
    steps += [{"event": "step", "restart": 0, "world": 4, "step": s, "tokens": 256, "time": 1.0 + s} for s in
              range(1, 31)]  # fmt: skip
    steps += [{"event": "start", "restart": 1, "world": 2, "step": 20, "ckpt": "c/last.ckpt", "time": 50.0}]
    steps += [{"event": "step", "restart": 1, "world": 2, "step": s, "tokens": 256, "time": 40.0 + s / 2} for s in
              range(21, 61)]  # fmt: skip
    _write(tmp_path / recovery.STEPS, steps)
    _write(tmp_path / recovery.FAULTS, [{"rank": 2, "step": 30, "phase": "backward", "time": 31.5}])
    facts = recovery.measure(tmp_path)
    assert facts["steps_lost"] == 10 and facts["resumed_from"] == "c/last.ckpt" and facts["final_step"] == 60
    assert facts["mttr_s"] == pytest.approx(40.0 + 21 / 2 - 31.5)
    assert (facts["world_before"], facts["world_after"]) == (4, 2)
    assert facts["tokens_per_s_before"] == pytest.approx(256.0) and facts["tokens_per_s_after"] == pytest.approx(512.0)


def test_overhead_is_paired_by_repeat():
    rows = [{"mode": m, "repeat": r, "step_s": s * (1 + r), "save_held_s": h} for r in (0, 1) for m, s, h in
            (("none", 1.0, 0.0), ("blocking", 2.0, 0.5), ("background", 1.5, 0.1))]  # fmt: skip
    summary = recovery.overhead_summary(rows)
    assert summary["blocking"]["over_none"] == pytest.approx(2.0) and summary["blocking"]["range"] == [2.0, 2.0]
    assert summary["background"]["save_held_s"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"phase": "lunch"}, "phase"), ({"scope": "rack"}, "scope"), ({"signal": "TERM"}, "signal"),
     ({"scope": "node"}, "torchrun")],
)
def test_a_fault_that_cannot_be_struck_is_refused(kwargs, message, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ValueError, match=message):
        KillAt(0, 5, **kwargs)


def test_the_reliability_page_shows_the_committed_figures():
    result = json.loads((ROOT / "docs" / "bench" / "recovery.json").read_text())
    page = (ROOT / "docs" / "reliability.md").read_text()
    assert recovery.tables(result) in page, "regenerate: python -c 'from dynmo_lightning.bench import recovery ...'"
    assert all(row["exact"] for row in result["rows"]) and result["soak"]["exact"]
    assert {row["phase"] for row in recovery.restart_rows(result)} == set(STEP_PHASES)
    moved = in_place.rows(result)
    assert in_place.tables(moved) in page, "regenerate: python -m dynmo_lightning.bench.in_place --out docs/bench"
    for mode in ("ddp", "fsdp"):  # every phase, a migration's and a consolidation's too; fsdp's copies
        assert [row["phase"] for row in moved if row["data_parallel"] == mode] == in_place.phases_of(mode)
    assert all(row["exact"] and row["steps_lost"] == 0 for row in moved)


def test_the_reliability_page_shows_what_being_ready_to_recover_costs():
    result = json.loads((ROOT / "docs" / "bench" / "recovery.json").read_text())
    page = (ROOT / "docs" / "reliability.md").read_text()
    assert set(result["in_place"]["overhead"]) == {"ddp", "fsdp"}
    assert in_place.overhead_table(result) in page, "regenerate: python -m dynmo_lightning.bench.in_place --overhead 5"


def test_in_place_figures_come_from_the_survivors_records(tmp_path):
    steps = [{"event": "step", "restart": 0, "world": 4, "step": s, "tokens": 512, "time": float(s)} for s in
             range(1, 21)]  # fmt: skip
    steps += [{"event": "step", "restart": 0, "world": 2, "step": s, "tokens": 512, "time": 20.0 + (s - 20) / 2}
              for s in range(21, 41)]  # fmt: skip  (step 20 again, from 23.5 s, faster: the test's numbers)
    steps[20]["time"] = 23.5
    _write(tmp_path / recovery.STEPS, steps)
    _write(tmp_path / recovery.FAULTS, [{"rank": 3, "step": 20, "phase": "forward", "time": 20.5}])
    _write(tmp_path / in_place.LOSSES, [{"step": s, "loss": 5.0 - s / 10} for s in range(40)])
    reference = tmp_path / "reference"
    reference.mkdir()
    _write(reference / in_place.LOSSES, [{"step": s, "loss": 5.0 - s / 10 + (1e-7 if s > 30 else 0)} for s in
                                          range(40)])  # fmt: skip
    facts = in_place.measure(tmp_path, reference)
    assert facts["steps_lost"] == 0 and facts["mttr_s"] == pytest.approx(3.0)
    assert (facts["world_before"], facts["world_after"]) == (4, 2) and facts["exact"]
    assert facts["ideal_tokens_per_s_after"] == pytest.approx(facts["tokens_per_s_before"] / 2)
    _write(reference / in_place.LOSSES, [{"step": s, "loss": 5.0 - s / 10 + (1e-3 if s > 30 else 0)} for s in
                                          range(40)])  # fmt: skip
    assert not in_place.measure(tmp_path, reference)["exact"]


def test_the_front_page_sentences_are_the_committed_result():
    result = json.loads((ROOT / "docs" / "bench" / "recovery.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert " ".join(recovery.front_page(result).split()) in readme
    assert " ".join(in_place.front_page(result).split()) in readme
