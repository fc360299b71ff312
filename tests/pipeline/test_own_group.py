"""A group of one process on its device's backend: FSDP2 over one replica, and the ``"dp"`` dimension of the public
device mesh with one replica (a user's ``fully_shard(mesh=strategy.pipeline_control.device_mesh["dp"])``, Lightning's
``ModelParallelStrategy`` convention), NCCL on CUDA devices.

No GPU here: the default group's backend and its device binding are stand-ins, and ``new_group`` / ``split_group``
record what they were asked. A device-bound NCCL default group splits its communicator for every new group with every
process of the parent taking part, so those groups are made in one split per pipeline when the mesh is made; gloo and
an unbound default group make them with their member alone, on first use.
"""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dynmo_lightning.pipeline.topology.mesh import make_mesh, own_group, own_group_needs_all
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout

pytestmark = pytest.mark.timeout(60)

CUDA, CPU = torch.device("cuda", 1), torch.device("cpu")
TIMEOUT = timedelta(seconds=5)


class Group:
    def __init__(self, backend: str, name: str) -> None:
        self.backend, self.name = backend, name


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``world(backend, bound)``: a default group of ``backend``, device-bound or not; ``calls`` records groups made."""
    calls: list[tuple] = []

    def new_group(ranks=None, timeout=None, backend=None, use_local_synchronization=False):
        calls.append(("new_group", ranks, backend, use_local_synchronization))
        return Group(backend or dist.get_backend(), f"new{ranks}")

    def split_group(parent=None, split_ranks=None, timeout=None):
        calls.append(("split_group", parent.name if parent else None, split_ranks))
        return Group(dist.get_backend(), f"split of {parent.name if parent else 'world'}")

    def set_world(backend: str, bound: bool) -> list[tuple]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: group.backend if group else backend)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        world_group = types.SimpleNamespace(bound_device_id=CUDA if bound else None)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: world_group)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4 if group is None else 2)
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "split_group", split_group)
        return calls

    return set_world


@pytest.mark.parametrize(
    ("backend", "bound", "host", "expected"),
    [
        ("gloo", False, True, ("new_group", [3], "gloo", True)),  # CPU: gloo, by this process alone
        ("nccl", False, False, ("new_group", [3], None, True)),  # CUDA, lazy communicators: NCCL, alone
        ("nccl", True, False, ("split_group", None, [[0], [1], [2], [3]])),  # CUDA, bound: NCCL, one split of all
    ],
)
def test_a_group_of_its_own_is_on_the_devices_backend(world, backend, bound, host, expected):
    calls = world(backend, bound)
    group = own_group(3, None, host, TIMEOUT)
    assert calls == [expected]
    assert group.backend == backend
    assert own_group_needs_all(host) == (expected[0] == "split_group")


def test_one_replica_on_bound_nccl_splits_each_pipeline_once_for_the_dp_dimension(world):
    calls = world("nccl", True)
    mesh = make_mesh(ReplicaLayout.even(4, 1, 2), 3, TIMEOUT, CUDA)  # two pipelines (tensor parallelism), D = 1
    splits = [c for c in calls if c[0] == "split_group"]
    # one split of this process's pipeline gives each of its processes a group: no world-wide split per process
    assert splits == [("split_group", "new[1, 3]", [[0], [1]])]
    assert mesh.own_group is not None and mesh.dp_dimension is mesh.own_group
    assert mesh.dp_dimension.backend == "nccl" and mesh.replica_group is None


def test_units_over_one_replica_on_bound_nccl_get_the_split_group(world):
    calls = world("nccl", True)
    mesh = make_mesh(ReplicaLayout.even(4, 1), 3, TIMEOUT, CUDA, unit_groups=True)
    assert [c for c in calls if c[0] == "split_group"] == [("split_group", None, [[0], [1], [2], [3]])]
    assert [c for c in calls if c[0] == "new_group" and c[1] is not None and len(c[1]) == 1] == []
    assert mesh.replica_group is mesh.own_group is mesh.dp_dimension


@pytest.mark.parametrize(("backend", "device", "expected"), [("nccl", CUDA, None), ("gloo", CPU, "gloo")])
def test_otherwise_the_dp_dimension_is_made_on_first_use_by_this_process_alone(world, backend, device, expected):
    calls = world(backend, False)
    mesh = make_mesh(ReplicaLayout.even(4, 1), 3, TIMEOUT, device)
    assert mesh.own_group is None
    made = len(calls)
    dp = mesh.dp_dimension
    assert calls[made:] == [("new_group", [3], expected, True)]
    assert mesh.dp_dimension is dp  # made once
    assert dp.backend == backend  # NCCL on CUDA, gloo on the CPU
