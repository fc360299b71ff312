"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from dynmo_lightning.launch import DIST_ENV


@pytest.fixture(autouse=True)
def _clean_distributed():
    """In-process Trainer runs leave a process group (with a listening store) and env vars behind: drop both."""
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
