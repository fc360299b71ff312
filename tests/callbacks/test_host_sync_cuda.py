"""On CUDA, ``HostSyncCounter`` counts a host read once: the read method's call, not again the sync it reports.

No GPU here: ``Tensor.item`` and a boolean-mask gather warn as CUDA's sync debug mode does (the warning from inside
the op), and the debug mode itself is a stand-in (a CPU build has none).
"""

from __future__ import annotations

import warnings

import torch

from dynmo_lightning.callbacks import HostSyncCounter

SYNC = "called a synchronizing CUDA operation"


def test_a_read_counts_once_and_a_kernels_sync_outside_the_reads_counts_too(monkeypatch):
    item = torch.Tensor.item

    def synchronising_item(t: torch.Tensor):
        warnings.warn(SYNC, UserWarning, stacklevel=2)
        return item(t)

    def masked_gather(t: torch.Tensor) -> torch.Tensor:  # e.g. t[t > 0]: the kernel synchronises, no read method
        warnings.warn(SYNC, UserWarning, stacklevel=2)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "item", synchronising_item)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    counter = HostSyncCounter(cuda=True, dispatch=False)
    t = torch.tensor([1.0, 2.0])
    with counter.patched():
        counter.on_train_batch_start(None, None, None, 0)
        t[0].item()
        t[1].item()
        counter.on_train_batch_start(None, None, None, 1)
        t[0].item()
        masked_gather(t)
        counter.on_train_end(None, None)
    assert counter.counts == [2, 2]  # two reads; one read and one synchronising kernel
