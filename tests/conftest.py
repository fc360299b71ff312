"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from dynmo_lightning.launch import FIT_ENV

# Processes the tests start (launched ranks, torchrun workers, scripts) import the test helpers as the tests do, as
# the package ``support`` below tests/: pytest's ``pythonpath = ["tests"]`` reaches this process only.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)

# The environment before any test ran: a Trainer exports rendezvous variables (LOCAL_RANK, MASTER_PORT, ...) and a
# module-scoped fixture's fit runs before any per-test snapshot could be taken.
_PRISTINE = {k: os.environ.get(k) for k in FIT_ENV}


@pytest.fixture(autouse=True)
def _clean_distributed():
    """In-process Trainer runs leave a process group (with a listening store) and env vars behind: drop both."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in _PRISTINE.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
