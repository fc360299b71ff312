"""The straggler results file (issue 47): docs/benchmarks.md shows its tables, and it has the issue's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmo_lightning.bench.straggler import merge, tables
from dynmo_lightning.plots import DASH, TIMES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "bench" / "straggler.json"

REAL = [{"case": "steady", "policy": "optimal", "over_uniform": 1.2, "ci95": [1.1, 1.3], "share_of_ideal": 0.9}]
SIM = [
    {"n_stages": 8, "speed": 0.5, "pattern": "steady", "dynamic": d, "over_uniform": o, "over_static_time": s,
     "share_of_oracle": sh, "moves_per_event": m}
    for d, o, s, sh, m in (("none", 1.5, 1.4, 0.97, 1.0), ("freezing", 1.7, 1.3, 0.93, 2.0))
]  # fmt: skip


def test_merge_and_tables():
    merged = merge({"real": REAL, "command": ["a"]}, {"simulated": SIM, "command": "b", "settings": {"k": 1}})
    assert merged["real"] == REAL and merged["simulated"] == SIM
    assert merged["commands"] == {"real": ["a"], "simulated": "b"} and merged["settings"]["simulated"] == {"k": 1}
    text = "\n".join(tables(merged))
    assert f"| steady | optimal | 1.20{TIMES} | [1.100, 1.300] | 90 % |" in text
    assert f"| 8 | 0.5 | steady | 1.50{DASH}1.70{TIMES} | 1.30{DASH}1.40{TIMES} | 93 % | 2.00 |" in text
    assert "least 93 %" in text
    assert merge(None, {"simulated": SIM})["commands"] == {"simulated": None}


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed straggler results")
def test_the_page_shows_the_committed_numbers_and_they_meet_the_bars():
    results = json.loads(RESULTS.read_text())
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for line in tables(results):
        assert line in page, f"docs/benchmarks.md lacks (python -m dynmo_lightning.bench.straggler table): {line}"
    for row in results["real"]:
        assert {"case", "policy", "over_uniform", "ci95", "share_of_ideal"} <= row.keys()
    assert {r["case"] for r in results["real"]} >= {"steady", "intermittent"}
    keys = {"n_stages", "speed", "pattern", "dynamic", "over_uniform", "over_static_time", "share_of_oracle",
            "moves_per_event"}  # fmt: skip
    assert all(keys <= r.keys() for r in results["simulated"])
    assert {r["n_stages"] for r in results["simulated"]} == {8, 16, 32}
    assert {r["speed"] for r in results["simulated"]} == {0.5, 0.7, 0.9}
    assert {r["pattern"] for r in results["simulated"]} == {"steady", "intermittent"}
