"""The link measurement sends from the backend's device and reads a GPU's clock only after its transfers finished.

No GPU here: NCCL is a backend name (``dist.get_backend`` patched), its tensors fake CUDA tensors (``FakeTensorMode``)
and the transfers, the barrier and CUDA's events and synchronisation stand-ins that log what happened in which order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from dynmo_lightning.bench import real


class _Event:
    """A CUDA event stand-in: its elapsed time can be read only once the device was synchronised after it."""

    def __init__(self, log: list[str], enable_timing: bool = False) -> None:
        self.log, self.synced = log, False
        assert enable_timing

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")  # waits until the device has reached this event

    def elapsed_time(self, end: _Event) -> float:
        assert self.log[-1] == "synchronize", "read the events before the device finished the transfers"
        return 2.0  # milliseconds


@pytest.mark.parametrize(("backend", "device"), [("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))])
def test_p2p_tensors_live_on_the_backends_device_and_the_clock_waits_for_them(monkeypatch, backend, device):
    log: list[str] = []
    sent: list[torch.device] = []

    def transfer(kind: str) -> Any:
        def op(t: torch.Tensor, peer: int) -> None:
            sent.append(t.device)
            log.append(kind)

        return op

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: log.append("barrier"))
    monkeypatch.setattr(dist, "send", transfer("send"))
    monkeypatch.setattr(dist, "recv", transfer("recv"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _Event(log, **kw))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    with FakeTensorMode():
        link = real.measure_p2p(4096, repeats=3)
    # latency and bandwidth: a ping-pong per repeat, after one untimed (NCCL creates the pair's communicator then)
    assert set(sent) == {device} and len(sent) == 2 * 2 * (3 + 1)
    assert log[:3] == ["send", "recv", "barrier"], log
    if device.type == "cuda":
        # per measurement: the untimed round, barrier, start event, the transfers, end event, then the synchronisation
        assert log[2:5] == ["barrier", "record", "send"] and log[10:12] == ["record", "synchronize"], log
        assert link["p2p_latency_s"] == pytest.approx(2e-3 / 6)
    else:
        assert "record" not in log and "synchronize" not in log
    assert link["p2p_bytes"] == 4096 and link["p2p_bytes_per_s"] > 0
