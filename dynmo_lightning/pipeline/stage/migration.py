"""Move pipeline layers between processes with everything that defines them.

A layer travels as the module object itself, so parameters, buffers, ``requires_grad`` flags, shapes (a pruned layer
arrives pruned) and any dynamic state a layer keeps in its attributes (masks, routers, thresholds, flags) all move
with it, together with the optimizer state of its parameters (e.g. Adam moments and step counts) and the index of
the parameter group each parameter belongs to. The module is pickled with its tensors replaced by references; the
pickle goes over the pipeline's CPU control group, the tensors with batched point-to-point operations (GPU to GPU
under NCCL), received directly into the receiver's new tensors (:mod:`~dynmo_lightning.pipeline.topology.transport`).

Migration is two-phase: every transfer completes and every receiver has rebuilt its layers before anyone commits;
only then do senders drop their copies and receivers install theirs, and the optimizers are updated in place (so LR
schedulers keep pointing at the same optimizer). Global layer order never changes: a plan is a new contiguous split.

Memory: until the commit a process holds what it had and what it received. Every local layer's gradients are
dropped before anything travels (the step that made them is done, and the next one starts from none; moved layers
arrive without gradients), and a received tensor becomes the parameter or optimizer state it carries (a layer held
in parts is rebuilt around its received parts,
:meth:`~dynmo_lightning.pipeline.parallel.data_parallel.StageSharding.adopt`), so a process's transient peak is its old
layers' parameters and optimizer state and the parameters and optimizer state it receives, plus one coalescing buffer of
small tensors at a time (``tests/pipeline/test_migration.py`` and ``tests/pipeline/test_migration_memory.py`` measure
it). A capacity check of a plan must allow for it: it exceeds the final placement by up to the outgoing layers'
parameters and optimizer state (:meth:`~dynmo_lightning.balance.steptime.memory_model.MemoryModel.migration_peaks`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dynmo_lightning.optim import drop_params
from dynmo_lightning.pipeline.parallel.compiled import reduce_compiled
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.parallel.dtensors import ShardedPickling
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.profiling import DeviceClock


@dataclasses.dataclass(frozen=True)
class Move:
    """Layers that go from pipeline rank ``src`` to pipeline rank ``dst``."""

    src: int
    dst: int
    layers: tuple[int, ...]


@dataclasses.dataclass
class MigrationStats:
    """What one migration did on this process.

    Attributes:
        moves: the transfers of the whole pipeline.
        bytes_sent: bytes this process sent.
        bytes_received: bytes it received.
        seconds: its time from start to end (device time: on GPU the transfers' end, not their enqueue).
        setup_seconds: the part of ``seconds`` spent opening device links to peers met for the first time.
    """

    moves: list[Move]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0

    @property
    def transfer_seconds(self) -> float:
        """``seconds`` without the one-off link set-up: what a bandwidth estimate should learn from."""
        return max(0.0, self.seconds - self.setup_seconds)

    def add(self, other: MigrationStats) -> None:
        """Count ``other``'s bytes and times in these."""
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.seconds += other.seconds
        self.setup_seconds += other.setup_seconds


def plan_moves(old: StagePlan, new: StagePlan) -> list[Move]:
    """The transfers that turn partition ``old`` into ``new``, in a global order every process agrees on."""
    if old.n_layers != new.n_layers:
        raise ValueError(f"partitions cover {old.n_layers} and {new.n_layers} layers")
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in range(old.n_layers):
        src, dst = old.rank_of_layer(i), new.rank_of_layer(i)
        if src != dst:
            pairs.setdefault((src, dst), []).append(i)
    return [Move(src, dst, tuple(layers)) for (src, dst), layers in sorted(pairs.items())]


# ---------------------------------------------------------------------------------------------------------------------
# Serialisation: pickle with tensors by reference; the tensors travel raw (pipeline/topology/transport.py)
# ---------------------------------------------------------------------------------------------------------------------
class _Packer(pickle.Pickler):
    """Pickles objects with tensors on ``device`` replaced by references into :attr:`tensors` (shared ones once).

    A DTensor (FSDP2 / replicate) is referenced by its local shard; an FSDP2 / replicate unit pickles as a plain
    module (:class:`~dynmo_lightning.pipeline.parallel.dtensors.ShardedPickling`).
    """

    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.device = device
        self.tensors: list[Tensor] = []
        self._keys: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        reduced = ShardedPickling.reduce_unit(obj)  # also strips a compiled forward
        return reduce_compiled(obj) if reduced is NotImplemented else reduced

    def persistent_id(self, obj: Any) -> Any:
        spec: tuple[Any, ...] = ()
        if isinstance(obj, DTensor):
            shard, dspec = ShardedPickling.dtensor_id(obj)
            spec = (dspec,)
        elif not isinstance(obj, Tensor) or obj.device != self.device:
            return None  # e.g. Adam's CPU step counters under NCCL: pickled inline
        else:
            shard = obj.detach()
        key = self._keys.get(id(obj))
        if key is None:
            key = self._keys[id(obj)] = len(self.tensors)
            self.tensors.append(shard)
        return key, obj.requires_grad, isinstance(obj, nn.Parameter), *spec


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor], mesh_of: Callable[[tuple], Any] | None) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._mesh_of = mesh_of
        self._made: dict[int, Tensor] = {}
        #: The received shard of every sharded parameter, by its (meta) placeholder's id.
        self.shards: dict[int, Tensor] = {}

    def persistent_load(self, pid: Any) -> Tensor:
        key, requires_grad, is_param, *spec = pid
        if key not in self._made:
            t = self._tensors[key]
            if spec:
                if self._mesh_of is None:
                    raise RuntimeError("a sharded layer arrived at a process whose layers are not sharded")
                t = ShardedPickling.dtensor_load(t, spec[0], is_param, self._mesh_of)
            made = nn.Parameter(t, requires_grad=requires_grad) if is_param else t.requires_grad_(requires_grad)
            if spec and is_param:
                self.shards[id(made)] = self._tensors[key]
            self._made[key] = made
        return self._made[key]


def _pack(obj: Any, device: torch.device) -> tuple[bytes, list[Tensor]]:
    """Pickle ``obj`` without its device tensors; returns the pickle and the tensors (contiguous) to send raw."""
    f = io.BytesIO()
    packer = _Packer(f, device)
    packer.dump(obj)
    return f.getvalue(), [t.contiguous() for t in packer.tensors]


def _unpack(blob: bytes, tensors: list[Tensor], mesh_of: Callable[[tuple], Any] | None = None) -> tuple[Any, dict]:
    """The object :func:`_pack` pickled, over ``tensors``; and the shards of its sharded parameters (by id)."""
    unpacker = _Unpacker(io.BytesIO(blob), tensors, mesh_of)
    return unpacker.load(), unpacker.shards


# ---------------------------------------------------------------------------------------------------------------------
def _optimizer_entries(layer: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, tuple[int, int, dict]]:
    """``{param name in layer: (optimizer index, group index, state)}`` for the layer's optimized parameters."""
    where = {}
    for o, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                where[id(p)] = (o, g, opt)
    out = {}
    for name, p in layer.named_parameters():
        if id(p) in where:
            o, g, opt = where[id(p)]
            out[name] = (o, g, dict(opt.state.get(p, {})))
    return out


def add_to_optimizers(
    layer: nn.Module, entries: dict[str, tuple[int, int, dict]], optimizers: Sequence[Optimizer]
) -> None:
    """Add a received layer's parameters, with their state, to the optimizer groups they came from."""
    params = dict(layer.named_parameters())
    for name, (o, g, state) in entries.items():
        p = params[name]
        group = optimizers[o].param_groups[g]["params"]
        if any(q is p for q in group):
            continue  # a parameter shared by layers that arrived together (a tie) is optimized once
        group.append(p)
        if state:
            optimizers[o].state[p] = state


def pack_layers(
    layers: dict[int, nn.Module], optimizers: Sequence[Optimizer], device: torch.device
) -> tuple[bytes, list[Tensor]]:
    """What migration sends for ``layers``: the pickle (structure, optimizer entries) and the tensors on ``device``.

    The round trip :func:`pack_layers` -> :func:`unpack_layers` is migration without the wire (the GPU check runs it
    in one process).
    """
    return _pack({i: (m, _optimizer_entries(m, optimizers)) for i, m in layers.items()}, device)


def unpack_layers(
    blob: bytes, tensors: list[Tensor], sharding: StageSharding | None = None
) -> dict[int, tuple[nn.Module, dict]]:
    """The layers of a :func:`pack_layers` message over ``tensors`` (as received), with their optimizer entries.

    Layers sent as FSDP2 / replicate units (or split over a tensor-parallel group) are units (split) again over the
    receiver's groups (``sharding``), holding the parts that came. :func:`add_to_optimizers` puts a layer's
    parameters and state into the receiver's optimizers.
    """
    parts = sharding is not None and (sharding.units or sharding.tensor_parallel is not None)
    layers, shards = _unpack(blob, tensors, sharding.mesh_of if parts else None)
    if shards:
        assert sharding is not None
        layers = {i: (sharding.adopt(i, module, shards), entries) for i, (module, entries) in layers.items()}
    return layers


def _send_layers(
    slots: LayerSlots, optimizers: Sequence[Optimizer], indices: Sequence[int], peer: int, pipe: PipelineGroup
) -> int:
    """Send layers ``indices`` with their optimizer entries to global rank ``peer``; returns the bytes sent.

    A layer that cannot be packed is reported to the receiver instead (which then fails at once, not at the
    timeout); the error is raised here too.
    """
    try:
        blob, tensors = pack_layers({i: slots.get(i) for i in indices}, optimizers, pipe.device)
    except Exception as e:
        transport.send_header(f"{type(e).__name__}: {e}", peer, pipe)
        raise
    transport.send_header((blob, [(t.dtype, tuple(t.shape)) for t in tensors]), peer, pipe)
    if tensors:
        transport.send_tensors(tensors, peer, pipe)
    return len(blob) + sum(t.numel() * t.element_size() for t in tensors)


def _recv_layers(
    peer: int, pipe: PipelineGroup, sharding: StageSharding | None
) -> tuple[dict[int, tuple[nn.Module, dict]], int]:
    """Receive what :func:`_send_layers` sent: ``{index: (layer, optimizer entries)}`` and the bytes received."""
    header = transport.recv_header(peer, pipe)
    if isinstance(header, str):
        raise RuntimeError(f"global rank {peer} could not send its layers: {header}")
    blob, specs = header
    # Large tensors are received straight into their final memory.
    tensors = [torch.empty(shape, dtype=dtype, device=pipe.device) for dtype, shape in specs]
    if tensors:
        transport.recv_tensors(tensors, peer, pipe)
    size = len(blob) + sum(t.numel() * t.element_size() for t in tensors)
    return unpack_layers(blob, tensors, sharding), size


def _transfer(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    pairs: Sequence[tuple[int, int, Sequence[int]]],
    me: int,
    pipe: PipelineGroup,
    stats: MigrationStats,
    clock: DeviceClock,
    sharding: StageSharding | None = None,
) -> dict[int, tuple[nn.Module, dict]]:
    """This process's part of ``pairs``: ``(src, dst, layers)`` in global ranks, in the same order on every process.

    Returns what it received (sharded layers already units again, over ``sharding``'s replicas); adds its bytes and
    link set-up time to ``stats``.
    """
    received: dict[int, tuple[nn.Module, dict]] = {}
    for src, dst, layers in pairs:
        if me not in (src, dst):
            continue
        peer = dst if me == src else src
        stats.setup_seconds += transport.open_link(peer, pipe, clock)
        if me == src:
            stats.bytes_sent += _send_layers(slots, optimizers, layers, peer, pipe)
        else:
            got, size = _recv_layers(peer, pipe, sharding)
            received.update(got)
            stats.bytes_received += size
    return received


def _install(slots: LayerSlots, received: dict[int, tuple[nn.Module, dict]], optimizers: Sequence[Optimizer]) -> None:
    """Install received layers in layer order and add their parameters (with state) to the optimizers."""
    for i, (module, entries) in sorted(received.items()):
        slots.install(i, module)
        add_to_optimizers(module, entries, optimizers)


def _leaving_params(slots: LayerSlots, leaving: set[int]) -> list[nn.Parameter]:
    """Parameters of the ``leaving`` layers that no staying layer shares (a tie's staying copy is kept)."""
    staying = {id(p) for i in slots.local_indices() if i not in leaving for p in slots.get(i).parameters()}
    return [p for i in sorted(leaving) for p in slots.get(i).parameters() if id(p) not in staying]


def _two_phase(
    what: str,
    group: dist.ProcessGroup | None,
    transfer: Callable[[], dict[int, tuple[nn.Module, dict]]],
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    release: Callable[[], None] = lambda: None,
) -> None:
    """Run this process's transfers, agree over ``group`` that all succeeded, and only then commit.

    Committing is ``release`` (what leaves this process) and installing what arrived, in layer order.

    Raises:
        RuntimeError: a transfer failed here or on another process; nothing was committed anywhere.
    """
    received, error = {}, None
    try:
        received = transfer()
    except Exception as e:
        error = e
    if not transport.all_agree(error is None, group):
        raise RuntimeError(
            f"{what} failed on {'this process' if error is not None else 'another process'}; nothing was changed"
        ) from error
    release()
    _install(slots, received, optimizers)


def migrate(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    old: StagePlan,
    new: StagePlan,
    *,
    pipe: PipelineGroup,
    sharding: StageSharding | None = None,
    job: dist.ProcessGroup | None = None,
    job_wide: bool = False,
) -> MigrationStats:
    """Carry out ``old -> new`` on this process (collective over the pipeline group; every rank must call it).

    Under ``data_parallel="fsdp"`` every replica's pipeline moves its own shards (the same plan in every replica:
    each source sends its shards to the process of its replica that receives the layer).

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (updated in place).
        old: the current partition.
        new: the target partition.
        pipe: this process's pipeline (rank, groups, members' global ranks, the device tensors travel on).
        sharding: how replicas share the layers (units are sent as shards and made units again on arrival).
        job: the CPU group of the whole job (``None``: the default group, as ``Mesh.control``).
        job_wide: commit together with every process of ``job``, not only the pipeline's: where a replica's move must
            not commit without the others' (FSDP2's copies on replica peers survive a loss only if no layer moved:
            ``pipeline/elastic/mirror.py``).

    Returns:
        The transfers and this process's bytes sent/received and time.

    Raises:
        RuntimeError: a transfer failed on some process; nothing was committed anywhere.
    """
    clock = DeviceClock(pipe.device)
    start = clock.now()
    moves = plan_moves(old, new)
    stats = MigrationStats(moves)
    leaving = {i for move in moves if pipe.rank == move.src for i in move.layers}
    outgoing = _leaving_params(slots, leaving)
    for i in slots.local_indices():
        for p in slots.get(i).parameters():
            p.grad = None  # dead (see the module docstring): not held while layers travel
    pairs = [(pipe.global_rank(m.src), pipe.global_rank(m.dst), m.layers) for m in moves]

    def release() -> None:
        # A parameter shared with a layer that stays (a tie) stays in the optimizer; the moving layer takes a copy.
        drop_params(outgoing, optimizers)
        for i in sorted(leaving):
            slots.remove(i)

    _two_phase(
        f"layer migration {list(old.layers_per_stage)} -> {list(new.layers_per_stage)}",
        job if job_wide else pipe.control,
        functools.partial(
            _transfer, slots, optimizers, pairs, pipe.global_rank(pipe.rank), pipe, stats, clock, sharding
        ),
        slots,
        optimizers,
        release,
    )
    stats.seconds = clock.elapsed(start, clock.now())
    return stats


def replicate(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    copies: Sequence[tuple[int, int]],
    *,
    pipe: PipelineGroup,
    job: dist.ProcessGroup | None,
    sharding: StageSharding | None = None,
) -> MigrationStats:
    """Copy every layer of each ``src`` to ``dst`` (global ranks of ``pipe``), with optimizer state (collective).

    A new data-parallel replica is made this way from a live one: the receiver must hold no layers; the sender keeps
    its own. Two-phase as :func:`migrate`, agreed over the whole job: receivers install what they got only when every
    copy arrived everywhere.

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (receivers' are updated in place).
        copies: ``(src, dst)`` pairs of global ranks of one pipeline each, the same list on every process.
        pipe: this process's pipeline (the copies of its pairs travel on its groups).
        job: the CPU group of the whole job (``Mesh.control``).
        sharding: how replicas share the layers: a copy of a unit arrives as the source's parts and is a unit again
            over the receiver's replica group, at the source's place in it (``pipeline/stage/reshape.py`` re-homes it in
            the new world).
    """
    clock = DeviceClock(pipe.device)
    start = clock.now()
    stats = MigrationStats(moves=[])
    me = pipe.global_rank(pipe.rank)
    receiving = any(me == dst for _, dst in copies)
    # Checked by everyone before any transfer: a receiver that cannot take a copy must not leave its sender blocked.
    if not transport.all_agree(not (receiving and slots.local_indices()), job):
        raise RuntimeError(
            f"copying layers to new replicas {list(copies)}: a receiving process still holds layers "
            f"({slots.local_indices() if receiving else 'on another process'}); nothing was changed"
        )
    mine = [(src, dst, slots.local_indices() if me == src else ()) for src, dst in copies if me in (src, dst)]
    transfer = functools.partial(_transfer, slots, optimizers, mine, me, pipe, stats, clock, sharding)
    _two_phase(f"copying layers to new replicas {list(copies)}", job, transfer, slots, optimizers)
    stats.seconds = clock.elapsed(start, clock.now())
    return stats


def pack(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    plan: StagePlan,
    keep_ranks: Sequence[int],
    layers_per_stage: Sequence[int],
    copies: Sequence[tuple[int, int]],
    *,
    pipe: PipelineGroup,
    job: dist.ProcessGroup | None,
    sharding: StageSharding | None = None,
    job_wide: bool = False,
) -> MigrationStats:
    """Move every layer onto the pipeline ranks ``keep_ranks``, then copy them to new replicas (collective).

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (updated in place).
        plan: the partition now (one stage per rank).
        keep_ranks: pipeline ranks that keep running, in order; new stage ``s`` lands on ``keep_ranks[s]``.
        layers_per_stage: the partition over the kept ranks.
        copies: ``(src, dst)`` global ranks: every layer of ``src`` is copied to ``dst`` (see :func:`replicate`).
        pipe: this process's pipeline.
        job: the CPU group of the whole job.
        sharding: how replicas share the layers (see :func:`migrate`).
        job_wide: the moves commit over ``job`` (see :func:`migrate`).
    """
    target = [0] * plan.n_ranks
    for stage, rank in enumerate(keep_ranks):
        target[rank] = layers_per_stage[stage]
    new = plan.with_layers(target)
    stats = migrate(slots, optimizers, plan, new, pipe=pipe, sharding=sharding, job=job, job_wide=job_wide)
    if copies:
        stats.add(replicate(slots, optimizers, copies, pipe=pipe, job=job, sharding=sharding))
    return stats
