"""The composition matrix (``docs/bench/composition.json``, written by ``tests/support/composition.py``).

Every feature x {ddp D = 2, fsdp D = 2, replicate D = 2, T = 2, fsdp D = 2 x T = 2} x {1F1B, ZBV} is either exact
against one process (fp32, relative <= 1e-5 per step and for the final model, and the feature visibly acted) or
refused before any worker starts by a row of docs/errors.md. The fast lane checks the committed file: its shape, its
verdicts, that every refusal is still what today's pre-launch checks say (and nothing else is refused now), and
that docs/scale_out.md shows it. The slow lane runs cells again and compares them with the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import composition
from support.helpers import slow

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "docs" / "bench" / "composition.json"


@pytest.fixture(scope="module")
def matrix() -> dict:
    return json.loads(RESULT.read_text())


def _key(cell: dict) -> tuple[str, str, str]:
    return cell["feature"], cell["mode"], cell["schedule"]


def test_every_cell_is_there_once(matrix):
    keys = [_key(c) for c in matrix["cells"]]
    want = {(f, m, s) for f in composition.FEATURES for m in composition.MODES for s in composition.SCHEDULES}
    assert len(keys) == len(set(keys)) and set(keys) == want


def test_every_cell_is_exact_or_refused_by_a_row(matrix):
    rows = composition._errors_rows()
    for cell in matrix["cells"]:
        where = _key(cell)
        assert cell["verdict"] in ("exact", "refused"), (where, cell["verdict"], cell.get("log", "")[-1500:])
        if cell["verdict"] == "exact":
            assert cell["loss_rel"] <= matrix["rtol"] and cell["model_rel"] <= matrix["rtol"], where
        else:
            assert cell["row"] in rows, (where, cell["message"])


def test_the_elastic_half_and_structured_pruning_run_in_parts(matrix):
    """What the issue asked for by name: repack, replicas from released processes, structured pruning under fsdp and
    under tensor parallelism, exact (not refused)."""
    verdict = {_key(c): c["verdict"] for c in matrix["cells"]}
    in_parts = ("fsdp D=2", "replicate D=2", "T=2", "fsdp D=2 x T=2")
    for feature in (
        "consolidation (P = 2 -> 1), released processes exit",
        "structured pruning (multiples of 2), layers moving",
    ):
        for mode in in_parts:
            assert verdict[(feature, mode, "1F1B")] == "exact", (feature, mode)
    # replicas of split stages need replicate or FSDP2 (row 47 refuses DDP ones: it cannot average DTensor parts)
    for mode in ("fsdp D=2", "replicate D=2", "fsdp D=2 x T=2"):
        assert verdict[("consolidation, released processes become replicas", mode, "1F1B")] == "exact", mode


@pytest.mark.timeout(300)
def test_refusals_are_todays(matrix):
    """Each cell's pre-launch verdict, asked again of today's checks, is the recorded one (the file is not stale)."""
    for cell in matrix["cells"]:
        overrides = composition._cell_overrides(composition.FEATURES[cell["feature"]], cell["mode"], cell["schedule"])
        message = composition.refusal(overrides, cell["world"])
        assert message == cell.get("message"), (_key(cell), message)
        if message is not None:
            assert composition.row_of(message) == cell["row"], (_key(cell), message)


def test_a_refusal_is_found_by_its_row():
    message = "balancer.repack with strategy.stages_per_rank=2: a consolidation plans one contiguous run of layers"
    assert composition.row_of(message + " for each process it keeps, and ...") == 52
    assert composition.row_of("something no row says") is None


def test_scale_out_shows_the_matrix(matrix):
    doc = (ROOT / "docs" / "scale_out.md").read_text()
    shown = doc.split(composition.BEGIN)[1].split(composition.END)[0].strip()
    assert shown == composition.table(matrix["cells"])


def test_the_table_reads_each_schedule_where_they_differ():
    cells = [
        {"feature": "f", "mode": "m", "schedule": "1F1B", "verdict": "exact"},
        {"feature": "f", "mode": "m", "schedule": "ZBV", "verdict": "refused", "row": 43},
        {"feature": "g", "mode": "m", "schedule": "1F1B", "verdict": "exact"},
        {"feature": "g", "mode": "m", "schedule": "ZBV", "verdict": "exact"},
    ]
    assert composition.table(cells).splitlines()[2:] == ["| f | exact / refused (row 43) |", "| g | exact |"]


#: The cells the slow lane runs again: the elastic half and structured pruning under fsdp and tensor parallel, and a
#: plain-SGD case per mode (a wrong gradient scale shows there).
AGAIN = {
    "fsdp D=2": [
        "consolidation (P = 2 -> 1), released processes exit",
        "consolidation, released processes become replicas",
        "shrink, then grow back when the load rises",
        "structured pruning (multiples of 2), layers moving",
        "plain SGD, no clipping, layers moving",
    ],
    "T=2": [
        "consolidation (P = 2 -> 1), released processes exit",
        "structured pruning (multiples of 2), layers moving",
        "plain SGD, no clipping, layers moving",
        "diffusion balancing",
    ],
    "fsdp D=2 x T=2": ["consolidation, released processes become replicas"],
}


@slow
@pytest.mark.parametrize("mode", list(AGAIN))
def test_cells_run_again_as_recorded(matrix, tmp_path, mode):
    cells = composition.run_matrix(tmp_path, [mode], AGAIN[mode])
    recorded = {_key(c): c for c in matrix["cells"]}
    for cell in cells:
        # "exact" is given only within the tolerance and when the feature acted (support/composition.py)
        assert cell["verdict"] == recorded[_key(cell)]["verdict"], (_key(cell), cell.get("log", "")[-2000:])


def test_every_refusal_of_the_table_is_its_row_of_errors_md():
    """The one table (``core/composition.REFUSALS``): each row's example is refused by it, its message is found as
    that row of docs/errors.md, and ``refuse`` raises it (the first that applies)."""
    from dynmo_lightning.core.composition import REFUSALS, refuse, refused

    for refusal in REFUSALS:
        assert refusal.applies(refusal.example), refusal.row
        message = refusal.message(refusal.example)
        assert composition.row_of(message) == refusal.row, (refusal.row, message)
        assert refused(refusal.example) is refusal
        with pytest.raises(ValueError, match=re.escape(message)):
            refuse(refusal.example)
