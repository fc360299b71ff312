"""Every Trainer call in a process gets a world of its own (`launch.fresh_world`); where a backend sends from.

Lightning's ``_init_dist_connection`` returns early when a process group exists: without ``fresh_world`` a second fit
inherits the first one's group, its backend included (the GPU check's CPU run after its CUDA run got NCCL).
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from support import SUPPORT

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import FIT_ENV, backend_device, fresh_world, run_ranks
from dynmo_lightning.models import GPT

SCRIPT = SUPPORT / "_fresh_world_script.py"

#: A second backend name on a CPU-only build: gloo under another name (what NCCL then gloo looks like to Lightning).
ALIAS = "gloo_fresh_world_test"


def _gloo(store: dist.Store, rank: int, size: int, timeout) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if ALIAS not in dist.Backend.backend_list:
    dist.Backend.register_backend(ALIAS, _gloo, devices=["cpu"])


class Seen(L.Callback):
    """The backend and group each fit trains in."""

    def __init__(self) -> None:
        self.worlds: list[tuple[str, int]] = []

    def on_train_start(self, trainer, pl_module):
        self.worlds.append((dist.get_backend(), id(dist.group.WORLD)))


def _fit(backend: str | None, seen: Seen) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[seen], logger=False,
                        strategy=DynMoStrategy(n_microbatches=2, process_group_backend=backend),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)  # fmt: skip
    model = GPT(n_layer=2, n_embd=16, n_head=2, block_size=16)
    trainer.fit(model, datamodule=StdlibCharDataModule(block_size=16, batch_size=4, max_bytes=50_000))


@pytest.mark.timeout(120)
def test_each_fit_trains_in_a_world_of_its_own_with_its_own_backend():
    before = {k: os.environ.get(k) for k in FIT_ENV}
    seen = Seen()
    for backend in (ALIAS, None):  # the first fit's backend must not carry over to the second
        with fresh_world():
            _fit(backend, seen)
        assert not dist.is_initialized()
        assert {k: os.environ.get(k) for k in FIT_ENV} == before  # MASTER_PORT, PL_GLOBAL_SEED, ... as on entry
    (first, group_1), (second, group_2) = seen.worlds
    assert (first, second) == (ALIAS, "gloo") and group_1 != group_2


def test_a_failed_call_ends_its_world_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")
    with pytest.raises(RuntimeError, match="the fit failed"), fresh_world():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        os.environ.update({"LOCAL_RANK": "0", "MASTER_PORT": str(store.port), "PL_GLOBAL_SEED": "0"})
        raise RuntimeError("the fit failed")
    assert not dist.is_initialized()
    assert "LOCAL_RANK" not in os.environ and os.environ["MASTER_PORT"] == "1234"
    assert "PL_GLOBAL_SEED" not in os.environ


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_started_from_outside_go_on_together_into_a_fresh_world(tmp_path):
    # Two ranks started as torchrun starts them (their store hosted here): the second fit cannot rendezvous at the
    # launcher's store again (its keys are the first world's), so it meets at the store the first world's rank 0 opened.
    out = tmp_path / "worlds.json"
    codes = run_ranks(2, [sys.executable, str(SCRIPT), str(out)], log_dir=tmp_path, tag="fw", timeout=240)
    logs = "".join((tmp_path / f"fw.rank{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [0, 0], logs
    result = json.loads(out.read_text())
    first, second = result["worlds"]
    assert first["world_size"] == second["world_size"] == 2 and result["steps"] == 2
    assert first["port"] != second["port"] and first["group"] != second["group"]


def test_backend_device_is_where_the_backend_sends_from(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # Lightning sets each rank's device current
    assert backend_device("nccl") == torch.device("cuda", 3)
    assert backend_device("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)  # activations travel on the GPU
    assert backend_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # by default: the default group's backend
    assert backend_device() == torch.device("cuda", 3)


def test_the_world_ends_in_order_at_exit(monkeypatch):
    """At interpreter exit the process group is destroyed first (registered once, however many fits)."""
    import atexit
    from datetime import timedelta

    import torch.distributed as dist

    from dynmo_lightning import launch
    from dynmo_lightning.pipeline.elastic import lifetimes as worlds
    from dynmo_lightning.pipeline.elastic.survivors import open_store

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(worlds, "_ends_at_exit", False)
    launch.end_world_at_exit()  # the users' door; the world's state lives in pipeline/elastic/lifetimes.py
    launch.end_world_at_exit()
    assert registered == [worlds._end_at_exit]
    dist.init_process_group("gloo", store=open_store("127.0.0.1", timedelta(seconds=30), world_size=1), rank=0,
                            world_size=1)  # fmt: skip
    registered[0]()
    assert not dist.is_initialized() and worlds._next_store is None
