"""Lightning's "`weights_only` was not set, defaulting to `False`" (issue 36, item 3): where it comes from.

``make train`` printed it twice (once per rank), which read as if checkpoints were loaded with ``weights_only=False``.
Lightning logs it in ``_CheckpointConnector.dump_checkpoint``: it is about *saving* (``Trainer.save_checkpoint``
without ``weights_only`` writes the full training state), never about loading. A resumed fit under the strategy
(sharded and single-file checkpoints; the strategy loads both with ``weights_only=True``) prints no such line and no
warning about ``weights_only``; ``save_checkpoint(path, weights_only=False)`` keeps Lightning's line away.
"""

from __future__ import annotations

import json

import pytest
from support import SUPPORT
from support.helpers import launch_script

LINE = "`weights_only` was not set, defaulting to `False`."


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume_lines")
    for fmt in ("sharded", "single"):
        launch_script(2, SUPPORT / "_weights_only_script.py", str(d), fmt, log_dir=d / "logs")
    return {fmt: [json.loads((d / f"{fmt}.rank{r}.json").read_text()) for r in (0, 1)] for fmt in ("sharded", "single")}


def _mentions(phase: dict) -> list[str]:
    return [line for line in phase["log"] + phase["warnings"] if "`weights_only`" in line or "weights_only=" in line]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["sharded", "single"])
def test_a_resumed_fit_prints_nothing_about_weights_only(phases, fmt):
    for rank, p in enumerate(phases[fmt]):
        assert p["resumed_from_step"] == 2 and p["global_step"] == 4, rank  # it did resume
        assert any("Restoring states from the checkpoint" in line for line in p["resumed fit"]["log"]) or rank, p
        assert _mentions(p["fit"]) == [] and _mentions(p["resumed fit"]) == [], (rank, p)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["sharded", "single"])
def test_the_line_is_lightnings_save_default_and_an_explicit_argument_removes_it(phases, fmt):
    for rank, p in enumerate(phases[fmt]):
        assert _mentions(p["save_checkpoint(path)"]) == [LINE], rank  # every rank dumps: printed once per rank
        assert _mentions(p["save_checkpoint(path, weights_only=False)"]) == [], rank
