"""Shared fixtures."""

from __future__ import annotations

import pytest

from dynmo_lightning.launch import fresh_world


@pytest.fixture(autouse=True)
def _clean_distributed():
    """In-process Trainer runs leave a process group (with a listening store) and env vars behind: drop both."""
    with fresh_world():
        yield
