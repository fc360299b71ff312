"""The front page's headline table holds the committed results: every number, in README.md and docs/performance.md.

Each number of the table is recomputed here from ``docs/bench/simulated.json`` (and the seed paper's figures kept in
``bench.scale.SEED``) and compared after the table's own rounding; the table is also what the report's generator
writes, so regenerating ``docs/bench/benchmarks.md`` keeps it.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from dynmo_lightning.bench import NAMES
from dynmo_lightning.bench.page import front_page_table, real_front_page
from dynmo_lightning.bench.scale import SEED

ROOT = Path(__file__).resolve().parents[1]
SIM = json.loads((ROOT / "docs" / "bench" / "simulated.json").read_text())
PAGES = [ROOT / "README.md", ROOT / "docs" / "performance.md"]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def headline_table(text: str) -> list[str]:
    """The lines of the first table whose header starts with ``| dynamic (preset) |``."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("| dynamic (preset) |"))
    end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")), len(lines))
    return lines[start:end]


def _runs(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [entry["by_stages"][str(p)] for p in SIM["stages"]]


def expected_numbers(dynamic: str) -> list[str]:
    """A row's numbers after its label, as the table rounds them, straight from the results file."""
    runs = _runs(SIM["dynamics"][dynamic])
    static = [cmp["policies"]["static_time"]["total_time"] for cmp in runs]
    over_uniform = [cmp["policies"]["optimal"]["speedup"] for cmp in runs]
    dynmo = [s / cmp["policies"]["optimal"]["total_time"] for s, cmp in zip(static, runs, strict=True)]
    oracle = [s / cmp["oracle"]["total_time"] for s, cmp in zip(static, runs, strict=True)]
    shares = sorted({round(100 * cmp["policies"]["optimal"]["share_of_oracle"]) for cmp in runs})
    shares = shares if len(shares) == 1 else [shares[0], shares[-1]]
    return [
        *(f"{v:.2f}" for v in (*over_uniform, *dynmo, *oracle)),
        *(str(s) for s in shares),
        f"{SIM['dynamics'][dynamic]['val_loss']:.3f}",
        f"{SEED[dynamic]:.2f}",
    ]


def mismatches(table: list[str]) -> list[str]:
    """Every way the table differs from the results file (empty: every number is the committed one)."""
    found = []
    header = NUMBER.findall(table[0])
    want = [*(str(p) for p in SIM["stages"]), f"{SIM['dynamics']['none']['val_loss']:.3f}"]
    if header != want:
        found.append(f"header numbers {header}, results {want}")
    by_name = {NAMES[d]: d for d in SIM["dynamics"] if d in SEED}
    seen = []
    for row in table[2:]:
        label, rest = row.strip("|").split("|", 1)
        m = re.fullmatch(r"\s*(.+?) \((.*?)([\d./]+)\)\s*", label)
        dynamic = by_name.get(m.group(1)) if m else None
        if dynamic is None:
            found.append(f"row {label.strip()!r}: no dynamic of the results file")
            continue
        seen.append(dynamic)
        strength = SIM["dynamics"][dynamic]["strength"]
        if Fraction(m.group(3)) != Fraction(strength).limit_denominator(1024):
            found.append(f"{dynamic}: strength {m.group(3)}, results {strength}")
        if (got := NUMBER.findall(rest)) != (want := expected_numbers(dynamic)):
            found.append(f"{dynamic}: {got}, results {want}")
    if sorted(seen) != sorted(by_name.values()):
        found.append(f"rows {seen}, dynamics of the results file {sorted(by_name.values())}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_of_the_headline_table_is_the_committed_one(page):
    assert mismatches(headline_table(page.read_text())) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_headline_table_is_what_the_generator_writes(page):
    assert headline_table(page.read_text()) == front_page_table(SIM)


def test_the_generated_benchmarks_page_holds_the_same_table():
    # ``dynmo-report docs/bench`` writes it there: a results file changed without regenerating shows here
    text = (ROOT / "docs" / "bench" / "benchmarks.md").read_text()
    assert headline_table(text) == front_page_table(SIM)


def test_editing_any_one_number_of_the_table_is_caught():
    table = headline_table((ROOT / "README.md").read_text())
    edits = 0
    for k, line in enumerate(table):
        for m in NUMBER.finditer(line):
            digit = m.end() - 1  # the last digit, changed by one
            edited = line[:digit] + str((int(line[digit]) + 1) % 10) + line[digit + 1 :]
            assert mismatches([*table[:k], edited, *table[k + 1 :]]), f"{edited!r} passed"
            edits += 1
    assert edits >= 13 * (len(table) - 2)  # 3 x 3 speed-ups, a share, a loss, the seed and the strength per row


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_real_ab_sentences_are_the_committed_results():
    # The README's real A/B (1F1B with its `static_time` arm, and the ZBV arm run in the same processes) is what
    # `real_front_page` writes from docs/bench/real.json and real_zbv.json: a rerun without editing the README shows
    bench = ROOT / "docs" / "bench"
    real, zbv = (json.loads((bench / name).read_text()) for name in ("real.json", "real_zbv.json"))
    sentences = real_front_page(real, zbv)
    assert len(sentences) == 2 and "static_time" in sentences[0] and "1F1B" in sentences[1]
    readme = _words((ROOT / "README.md").read_text())
    missing = [s for s in sentences if _words(s) not in readme]
    assert not missing, missing
