"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _helpers import CliRun, run_cli


@pytest.fixture
def cli(tmp_path: Path):
    """``cli(name, *overrides)`` runs dynmo-train in ``tmp_path / name``."""

    def _run(name: str, *overrides: str, **kwargs: Any) -> CliRun:
        return run_cli(tmp_path / name, *overrides, **kwargs)

    return _run
