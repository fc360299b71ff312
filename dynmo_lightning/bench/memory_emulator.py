"""The memory emulator's ground: fake tensors, FSDP2 over a fake process group, stages as the runtime builds them.

What :mod:`~dynmo_lightning.bench.memory_layers` (every layer alone) and :mod:`~dynmo_lightning.bench.memory_step`
(a rank's whole step) share: ``MemTracker`` without module hooks and the bytes it saw, and FSDP2 driven around a
backward as torch's pipeline stage drives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from dynmo_lightning.bench.memory_stacks import Stack
from dynmo_lightning.core.parts import fsdp_param_groups
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.stage.slots import StageModule
from dynmo_lightning.pipeline.topology.world import FixedWorld
from dynmo_lightning.profiling import LayerProfiler


@dataclasses.dataclass(frozen=True)
class Sharded:
    """FSDP2 in every stage (``data_parallel="fsdp"``) over ``replicas`` processes, emulated by one of them.

    The process joins a fake process group of ``replicas`` ranks (``torch.testing``'s ``FakeStore``: it is rank 0,
    collectives return at once) and its stages' layers become units over it as the strategy makes them
    (:class:`~dynmo_lightning.pipeline.parallel.data_parallel.StageSharding`): the shards, the gathered weights, the
    reduce-scatter's buffers are allocated as on a real replica.

    Attributes:
        replicas: processes sharing each stage (``D``).
        lean: ``fsdp_memory="lean"``.
    """

    replicas: int
    lean: bool = False


@contextlib.contextmanager
def fake_replicas(sharded: Sharded | None, autocast: bool) -> Iterator[StageSharding | None]:
    """Within: the sharding of ``sharded`` over a fake process group (see :class:`Sharded`); ``None``: none."""
    if sharded is None:
        yield None
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sharded.replicas)
    try:
        mesh = init_device_mesh("cpu", (sharded.replicas,), mesh_dim_names=("dp",))
        param_dtype = torch.bfloat16 if autocast else None  # bf16-mixed: FSDP2 computes in bf16, as the strategy's
        yield StageSharding("fsdp", FixedWorld(mesh), torch.device("cpu"), param_dtype, lean=sharded.lean)
    finally:
        dist.destroy_process_group()


class _Modules:
    """Stands in for ``MemTracker``'s module tracker: no hooks on modules.

    The module tracker attributes memory to modules through autograd hooks on their inputs and outputs, which
    torch's split backward (``autograd.grad`` over leaf inputs) refuses; the tracker's storage accounting and its
    peak, which are what this measures, do not need them (every byte counts as one kind then).
    """

    is_bw = False
    parents: tuple[str, ...] = ("Global",)

    def register_user_hooks(self, *hooks: Any) -> None:
        """No module hooks."""

    def clear_user_hooks(self) -> None:
        """No module hooks."""

    def __enter__(self) -> _Modules:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def hookless_tracker() -> MemTracker:
    """A ``MemTracker`` that puts no hooks on modules (:class:`_Modules`): it tracks storages and their peak only."""
    tracker = MemTracker()
    tracker._mod_tracker = _Modules()  # type: ignore[assignment]  # see _Modules
    return tracker


@contextlib.contextmanager
def fake_tensors(stack: Stack) -> Iterator[None]:
    """Within: fake tensors (nothing allocated), under bf16 autocast where ``stack`` computes so."""
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=stack.autocast):
        yield


def build_stage(
    stack: Stack,
    layers: range,
    recompute: bool,
    profiler: LayerProfiler | None = None,
    sharding: StageSharding | None = None,
) -> StageModule:
    """A stage of ``layers``; with ``sharding``, every layer a unit and the stage their root (as ``wrap`` makes it)."""
    torch.manual_seed(0)
    modules = [stack.layer(i) for i in layers]
    stage = StageModule(modules, layers.start, profiler, frozenset(layers) if recompute else frozenset())
    if sharding is not None:
        sharding.shard_layers(modules)
        sharding.wrap(stage, None)
    return stage


def tracked_bytes(tracker: MemTracker, kind: str) -> int:
    """The most bytes ``tracker`` saw on one device, of ``kind`` ``"current"`` or ``"peak"``."""
    return max((sum(v for k, v in snap.items() if k != "Total") for snap in tracker.get_tracker_snapshot(kind)
                .values()), default=0)  # fmt: skip


def before_backward(module: nn.Module, sharding: StageSharding | None) -> None:
    """Set FSDP2 up for a micro-batch's backward as the stage does (``PipelineStage.backward_maybe_with_nosync``).

    ``"fast"``: gradient sync off, whole gradients accumulated, weights kept; ``"lean"`` (the runtime's ``_Stage``):
    every unit reduce-scatters its gradient and frees its weights as its backward ends.
    """
    if sharding is None or not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(sharding.lean)
    module.set_requires_gradient_sync(sharding.lean)


def reduce_gradients(module: nn.Module) -> None:
    """The reduction after a stage's last backward, as torch's ``PipelineStage.perform_reduce_grad`` runs it."""
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for unit in state._state_ctx.all_states:
        for group in fsdp_param_groups(unit):
            group.post_backward()
    state._root_post_backward_final_callback()
