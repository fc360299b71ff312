"""Fixtures of the pipeline tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from dynmo_lightning.pipeline.elastic.survivors import open_store


@pytest.fixture
def one_process_world() -> Iterator[None]:
    """A gloo default process group of this process alone."""
    store = open_store("127.0.0.1", timedelta(seconds=30), world_size=1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
