"""Global unstructured pruning finds its threshold by bisection with all-reduced counts: no weights travel.

Before, every process sent all its weights' magnitudes to every other (``all_gather_object``, 28 GB per process at
7B) and ran ``kthvalue`` over the whole model on the host. Now each process counts its own elements at or below a
midpoint on the device and the counts are summed over all processes, 31 rounds of one number: the same threshold
as ``kthvalue``, whether the weights are whole on every process, sharded (DTensors) or copied on replicas.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dynmo_lightning.callbacks import GradualPruning
from dynmo_lightning.callbacks.pruning import global_magnitude_threshold
from tests.pipeline.conftest import one_process_world  # noqa: F401  (the fixture)
from tests.support._pruning_script import Stages
from tests.support.helpers import launch_script

pytestmark = pytest.mark.timeout(180)


def _stages() -> Stages:
    torch.manual_seed(0)
    layers = [nn.Linear(96, 128), nn.Linear(128, 64), nn.Linear(64, 96), nn.Linear(96, 8)]
    with torch.no_grad():
        layers[1].weight.copy_(layers[1].weight.bfloat16().float())  # values bf16 can hold, too
    return Stages(layers)


def _kthvalue_masks(module: Stages, fraction: float) -> list[torch.Tensor]:
    weights = [layer.weight.detach() for layer in module.layers[:-1]]
    magnitudes = torch.cat([w.abs().flatten() for w in weights])
    k = int(fraction * magnitudes.numel())
    threshold = float(magnitudes.kthvalue(k).values) if k > 0 else -1.0
    return [w.abs() > threshold for w in weights]


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.5, 0.6, 0.93])
def test_the_mask_is_the_one_kthvalue_gives(fraction):
    module = _stages()
    expected = _kthvalue_masks(module, fraction)
    opt = torch.optim.AdamW(module.parameters())
    GradualPruning(mode="unstructured")._prune_weights(module, fraction, [opt])
    for layer, mask in zip(module.layers[:-1], expected, strict=True):
        assert torch.equal(layer.weight != 0, mask)  # random values are distinct: the very same mask
    assert bool((module.layers[-1].weight != 0).all())


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each collective of this process receives (one entry per call); the others refuse to run."""
    received: list[int] = []
    reduce, gather = dist.all_reduce, dist.all_gather_object

    def all_reduce(tensor, *args, **kwargs):
        received.append(tensor.nbytes * dist.get_world_size())
        return reduce(tensor, *args, **kwargs)

    def all_gather_object(out, obj, *args, **kwargs):
        received.append(len(pickle.dumps(obj)) * len(out))
        return gather(out, obj, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("pruning used another collective")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    for name in ("all_gather", "all_gather_into_tensor", "broadcast", "broadcast_object_list", "gather", "scatter"):
        monkeypatch.setattr(dist, name, refuse)
    return received


@pytest.mark.usefixtures("one_process_world")
def test_no_process_receives_more_than_a_number_per_bisection_round(monkeypatch):
    module = _stages()
    expected = _kthvalue_masks(module, 0.6)
    received = _counting(monkeypatch)
    GradualPruning(mode="unstructured")._prune_weights(module, 0.6, [])
    # Before: one gather of every magnitude (106.9 KB received for these 26.6 K weights). Now 33 all-reduces
    # of 8 bytes (the element count, the largest magnitude, 31 rounds of counts) whatever the model's size.
    assert len(received) <= 33 and sum(received) <= 33 * 8, received
    for layer, mask in zip(module.layers[:-1], expected, strict=True):
        assert torch.equal(layer.weight != 0, mask)


def test_the_device_threshold_equals_kthvalue_over_mixed_dtypes():
    torch.manual_seed(1)
    parts = [torch.randn(300, 7), torch.randn(50).bfloat16(), torch.randn(3, 3, 3), torch.empty(0)]
    magnitudes = torch.cat([p.abs().float().flatten() for p in parts])
    for fraction in (0.0, 0.01, 0.5, 0.999):
        k = int(fraction * magnitudes.numel())
        expected = float(magnitudes.kthvalue(k).values) if k > 0 else -1.0
        assert float(global_magnitude_threshold(parts, fraction, torch.device("cpu"))) == expected


def test_sharded_and_replicated_weights_on_two_processes(tmp_path: Path):
    out = tmp_path / "pruning"
    launch_script(2, Path(__file__).parents[1] / "support" / "_pruning_script.py", str(out), log_dir=tmp_path)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    weights = [torch.randn(64, 48), torch.randn(32, 64), torch.randn(16, 32)]
    magnitudes = torch.cat([w.abs().flatten() for w in weights])
    for i, fraction in enumerate((0.1, 0.5, 0.77)):
        k = int(fraction * magnitudes.numel())
        kth = float(magnitudes.kthvalue(k).values)
        # Shards: every element counted once, the very threshold of kthvalue.
        assert ranks[0]["sharded"][i] == ranks[1]["sharded"][i] == kth
        # Replicas: every element counted twice, k of the doubled count: at most one element more is pruned.
        threshold = ranks[0]["replicated"][i]
        assert ranks[1]["replicated"][i] == threshold
        assert int((magnitudes <= threshold).sum()) - k in (0, 1)
    assert all(r["received_per_threshold"] <= 33 * 8 for r in ranks)
    # GradualPruning on DTensor weights (FSDP2 shards): the two shards hold the zeros of half of the two layers.
    first_two = [w.abs().flatten() for w in weights[:2]]
    pruned = int(0.5 * sum(m.numel() for m in first_two))
    assert sum(sum(r["zeros"][:2]) for r in ranks) == pruned and all(r["zeros"][2] == 0 for r in ranks)
