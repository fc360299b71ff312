"""Which device a process group's tensors live on, and which groups carry what: device mistakes made visible on CPU.

NCCL moves CUDA tensors only, gloo sends CPU tensors only. Without a GPU, the backend is patched to "nccl" to see
which device a helper picks, tensors are made on a fake CUDA device (``FakeTensorMode``: mixing them with a CPU
tensor raises), and a fake wire stands in for ``torch.distributed`` to see what goes over which group.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.pipeline.checkpoint import single_file as checkpoint
from dynmo_lightning.pipeline.elastic import survivors as groups
from dynmo_lightning.pipeline.stage.migration import _recv_layers, _send_layers
from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime, StagePlan
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup, group_device, make_mesh
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout
from dynmo_lightning.profiling import DeviceClock

pytestmark = pytest.mark.timeout(60)

CUDA = torch.device("cuda", 1)
GPU0 = torch.device("cuda", 0)  # what FakeTensorMode makes of "cuda"
CPU = torch.device("cpu")


class Group:
    """A stand-in process group of a backend."""

    def __init__(self, backend: str, name: str = "") -> None:
        self.backend, self.name = backend, name

    def __repr__(self) -> str:
        return f"Group({self.backend}, {self.name})"


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``set(default)``: the default group's backend; stand-in groups answer their own."""

    def set_default(default: str) -> None:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: group.backend if group else default)

    return set_default


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("nccl", CUDA, CUDA),
        ("gloo", CPU, CPU),
        ("gloo", CUDA, CPU),  # gloo's point-to-point takes CPU tensors only
        ("cpu:gloo,cuda:nccl", CPU, CPU),
        ("cpu:gloo,cuda:nccl", CUDA, CUDA),
    ],
)
def test_group_device_picks_the_backends_device(backend, name, device, expected):
    backend(name)
    assert group_device(device) == expected


@pytest.mark.parametrize("name", ["nccl", "cuda:nccl"])
def test_group_device_refuses_a_backend_that_cannot_move_the_devices_tensors(backend, name):
    backend(name)
    with pytest.raises(ValueError, match="destroy_process_group"):
        group_device(CPU)


def test_barrier_takes_device_ids_only_on_a_cuda_device(backend, monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: calls.append(kwargs))
    backend("nccl")
    groups.barrier(CUDA)
    backend("gloo")
    groups.barrier(CPU)
    assert calls == [{"device_ids": [1]}, {"device_ids": None}]


def test_a_cpu_fit_on_a_left_over_nccl_group_is_refused_at_the_barrier(backend, monkeypatch):
    """A second fit in one process reuses the first one's group (Lightning keeps it); on the CPU that cannot work."""
    from lightning.fabric.utilities import distributed as fabric_dist

    monkeypatch.setattr(fabric_dist, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: pytest.fail("no barrier may run"))
    backend("nccl")
    strategy = DynMoStrategy(parallel_devices=[CPU])
    with pytest.raises(ValueError, match="cannot move tensors of cpu"):
        strategy.barrier("after a GPU fit")


@pytest.fixture
def created(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every ``new_group`` call, with its arguments; each returns a stand-in group of its backend."""
    calls: list[dict] = []

    def new_group(ranks=None, timeout=None, backend=None, use_local_synchronization=False):
        calls.append({"ranks": ranks, "backend": backend, "local": use_local_synchronization})
        return Group(backend or dist.get_backend(), str(ranks))

    monkeypatch.setattr(dist, "new_group", new_group)
    return calls


def test_one_replica_makes_no_replica_groups(backend, created):
    backend("nccl")
    mesh = make_mesh(ReplicaLayout.even(8, 1), 3, timedelta(seconds=5), CUDA)
    # One group: the job's CPU control group. No one-rank replica groups (a world-wide NCCL split each).
    assert created == [{"ranks": None, "backend": "gloo", "local": False}]
    pipe = mesh.pipeline
    assert pipe.group is None and pipe.control is mesh.control and pipe.device == CUDA and mesh.dp_group is None


def test_one_replica_on_gloo_makes_no_group_at_all(backend, created):
    backend("gloo")
    mesh = make_mesh(ReplicaLayout.even(4, 1), 0, timedelta(seconds=5), CPU)
    assert created == [] and mesh.control is None and mesh.pipeline.control is None
    assert mesh.pipeline.device == CPU


def test_replicas_on_nccl_get_cpu_control_groups_made_by_their_members(backend, created):
    backend("nccl")
    mesh = make_mesh(ReplicaLayout.even(4, 2), 3, timedelta(seconds=5), CUDA)
    assert created == [
        {"ranks": None, "backend": "gloo", "local": False},  # the job's
        {"ranks": [0, 1], "backend": None, "local": False},
        # With a device-bound NCCL world, a non-member's new_group would join an NCCL split its members never enter.
        {"ranks": [0, 1], "backend": "gloo", "local": True},
        {"ranks": [2, 3], "backend": None, "local": False},
        {"ranks": [2, 3], "backend": "gloo", "local": True},
        {"ranks": [0, 2], "backend": None, "local": False},
        # The replica groups' CPU twins carry the host-known buffers' averages (sync_replica_buffers).
        {"ranks": [0, 2], "backend": "gloo", "local": True},
        {"ranks": [1, 3], "backend": None, "local": False},
        {"ranks": [1, 3], "backend": "gloo", "local": True},
    ]
    pipe = mesh.pipeline
    assert (pipe.group.name, pipe.group.backend) == ("[2, 3]", "nccl")
    assert (pipe.control.name, pipe.control.backend) == ("[2, 3]", "gloo")
    assert mesh.dp_group.name == "[1, 3]" and pipe.rank == 1 and pipe.device == CUDA


def test_gloo_with_cuda_devices_is_refused(backend, created):
    backend("gloo")
    with pytest.raises(ValueError, match="use 'nccl'"):
        make_mesh(ReplicaLayout.even(2, 1), 0, timedelta(seconds=5), CUDA)


def test_replicas_on_gloo_use_their_groups_as_control_groups(backend, created):
    backend("gloo")
    mesh = make_mesh(ReplicaLayout.even(4, 2), 0, timedelta(seconds=5), CPU)
    assert [c["backend"] for c in created] == [None] * 4
    assert mesh.pipeline.control is mesh.pipeline.group and mesh.control is None


def test_the_device_mesh_of_one_replica_is_made_on_first_use(one_process_world):
    mesh = make_mesh(ReplicaLayout.even(1, 1), 0, timedelta(seconds=5), CPU)
    device_mesh = mesh.device_mesh
    assert device_mesh.mesh_dim_names == ("dp", "pp") and tuple(device_mesh.shape) == (1, 1)
    assert mesh.device_mesh is device_mesh  # made once


# --- what travels where (a fake wire instead of torch.distributed) ---------------------------------------------------
class Wire:
    """Objects and tensors sent in one process, received in order; every call's group recorded.

    A receive only checks that the buffer matches what was sent (device, dtype, size): ``copy_`` between fake CUDA
    tensors needs a CUDA build, so the payloads in these tests are all large enough to travel as messages of their
    own (smaller ones are copied out of one byte buffer after the receive).
    """

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.calls: list[tuple[str, Any]] = []

    def send_object_list(self, objects, dst=None, group=None, device=None):
        self.calls.append(("object", group))
        self.objects.append(list(objects))

    def recv_object_list(self, box, src=None, group=None, device=None):
        self.calls.append(("object", group))
        box[:] = self.objects.pop(0)

    def batch_isend_irecv(self, ops):
        for op in ops:
            self.calls.append(("tensor", op.group))
            if op.op is dist.isend:
                self.tensors.append(op.tensor)
            else:
                sent = self.tensors.pop(0)
                assert (op.tensor.device, op.tensor.dtype, op.tensor.shape) == (sent.device, sent.dtype, sent.shape)
        return []


class Op:
    def __init__(self, op, tensor, peer, group) -> None:
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch, backend) -> Iterator[Wire]:
    backend("nccl")
    w = Wire()
    for name in ("send_object_list", "recv_object_list", "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, getattr(w, name))
    monkeypatch.setattr(dist, "P2POp", Op)
    yield w


NCCL, GLOO = Group("nccl", "pipeline"), Group("gloo", "control")


def _pipe(rank: int) -> PipelineGroup:
    return PipelineGroup(rank, NCCL, [0, 1], control=GLOO, device=GPU0)


def _headers_hold_no_tensors(wire: Wire) -> None:
    found: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    walk(wire.objects)
    assert not found


def test_layers_travel_device_to_device_with_their_header_on_the_control_group(wire):
    layer = nn.Sequential(
        nn.Linear(200, 200, bias=False, device="meta"), nn.Linear(200, 100, bias=False, device="meta")
    )
    with FakeTensorMode():
        for sub in layer.modules():  # fake CUDA parameters (random initialisation does not work on them)
            for name, p in list(sub.named_parameters(recurse=False)):
                sub._parameters[name] = nn.Parameter(torch.empty(p.shape, device="cuda"))
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        weight = layer[0].weight
        optimizer.state[weight] = {"momentum_buffer": torch.empty_like(weight), "note": 3}
        slots = LayerSlots(nn.ModuleList([layer]), [layer])
        sent = _send_layers(slots, [optimizer], [0], 1, _pipe(0))
        _headers_hold_no_tensors(wire)
        got, received = _recv_layers(0, _pipe(1), None)
    module, entries = got[0]
    assert sent == received > 200 * 200 * 4
    assert {t.device for t in (*module.parameters(), *module.buffers())} == {GPU0}
    _, _, state = entries["0.weight"]
    assert state["momentum_buffer"].device.type == "cuda" and state["note"] == 3
    assert {kind for kind, group in wire.calls if group is GLOO} == {"object"}
    assert {kind for kind, group in wire.calls if group is NCCL} == {"tensor"}


def test_the_shape_probe_sends_shapes_on_the_control_group_and_activations_on_the_device(wire):
    plan = StagePlan((1, 1), 2)
    runtimes = [
        PipelineRuntime(
            LayerSlots(nn.ModuleList(), []),
            plan,
            pipe=_pipe(r),
            device=GPU0,
            schedule="gpipe",
            n_microbatches=1,
            loss_fn=lambda out, target: out.sum(),
        )
        for r in (0, 1)
    ]
    with FakeTensorMode():
        hidden = torch.empty(64, 128, 2, device="cuda", requires_grad=True)
        ids = torch.zeros(64, 128, dtype=torch.long, device="cuda")
        mask = torch.ones(64, 1024, dtype=torch.bool, device="cuda")  # travels as its bytes
        runtimes[0]._send_activations((hidden, ids, mask), 1)
        _headers_hold_no_tensors(wire)
        x = runtimes[1]._recv_activations(0, train=True)
    assert [(t.shape, t.dtype, t.device.type, t.requires_grad) for t in x] == [
        ((64, 128, 2), torch.float32, "cuda", True),
        ((64, 128), torch.long, "cuda", False),
        ((64, 1024), torch.bool, "cuda", False),
    ]
    assert {kind for kind, group in wire.calls if group is GLOO} == {"object"}
    assert {kind for kind, group in wire.calls if group is NCCL} == {"tensor"}


def test_a_single_file_checkpoint_gathers_over_the_control_group(wire):
    parts = [
        {"state_dict": {"a": torch.ones(2)}, "optimizer_states": [_named({"a": {"step": 1}}, ["a"])], "loops": 7},
        {"state_dict": {"b": torch.zeros(3)}, "optimizer_states": [_named({"b": {"step": 2}}, ["b"])], "loops": 7},
    ]
    assert checkpoint.gather_checkpoint(parts[1], _pipe(1)) is None
    merged = checkpoint.gather_checkpoint(parts[0], _pipe(0))
    assert merged is not None and merged["loops"] == 7 and list(merged["state_dict"]) == ["a", "b"]
    assert merged["optimizer_states"][0]["state"] == {"a": {"step": 1}, "b": {"step": 2}}
    assert merged["optimizer_states"][0]["param_groups"][0]["params"] == ["a", "b"]
    assert {group for _, group in wire.calls} == {GLOO}


def _named(state: dict, names: list[str]) -> dict:
    return {"format": checkpoint.NAMED_FORMAT, "state": state, "param_groups": [{"lr": 0.1, "params": names}]}


def test_agreement_flags_refuse_a_device_group(backend):
    backend("nccl")  # a flag is host data: an NCCL group would take it to the GPU and back
    with pytest.raises(ValueError, match="cannot move tensors of cpu"):
        transport.all_agree(True, None)


# --- device time ---------------------------------------------------------------------------------------------------
class Event:
    """A stand-in CUDA event: records, and says when someone waited for it."""

    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = len(Event.log)

    def record(self) -> None:
        Event.log.append("record")

    def synchronize(self) -> None:
        Event.log.append("synchronize")

    def elapsed_time(self, end: Event) -> float:
        return 1000.0 * (end.at - self.at)


def test_device_time_is_read_from_events_and_waits_only_when_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Event)
    Event.log = []
    clock = DeviceClock(CUDA)
    start = clock.now()
    end = clock.now()
    assert Event.log == ["record", "record"]  # the host enqueued; nothing waited
    assert clock.elapsed(start, end) == 1.0 and Event.log[-1] == "synchronize"


def test_schedule_seconds_times_the_schedule_on_the_host_clock_on_cpu():
    clock = DeviceClock(CPU)
    strategy = DynMoStrategy()
    assert strategy.pipeline_control.schedule_seconds == 0.0
    strategy.pipeline_control.schedule_span = (clock, 1.0, 3.5)
    assert strategy.pipeline_control.schedule_seconds == 2.5
