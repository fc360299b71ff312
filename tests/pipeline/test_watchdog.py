"""Heartbeats across worlds: phases are named only inside a world, and a world's heartbeats stop once."""

from __future__ import annotations

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from dynmo_lightning.pipeline.topology.heartbeats import Heartbeats


def test_heartbeats_name_phases_only_inside_a_world():
    beats = Heartbeats(5.0, lambda: 7)
    with beats.phase("before any world"):  # nothing to name yet
        assert beats.watchdog is None
    environment = LightningEnvironment()
    environment.set_world_size(1)
    environment.set_global_rank(0)
    store = dist.TCPStore(environment.main_address, 0, is_master=True, wait_for_workers=False)
    beats.start(environment, [None, store], [0, store.port])  # the last store serves the heartbeats
    watchdog = beats.watchdog
    assert watchdog is not None and watchdog.stale_after == 5.0 and watchdog.interval == 1.0
    with beats.phase("training step 7 (pipeline schedule)"):
        assert watchdog.current == "training step 7 (pipeline schedule)"
    assert watchdog.current is None
    beats.stop()
    beats.stop()  # the world already ended: nothing left to stop
    assert beats.watchdog is None
