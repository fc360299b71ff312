"""Move pipeline layers between processes with everything that defines them.

A layer travels as the module object itself, so parameters, buffers, ``requires_grad`` flags, shapes (a pruned layer
arrives pruned) and any dynamic state a layer keeps in its attributes (masks, routers, thresholds, flags) all move
with it, together with the optimizer state of its parameters (e.g. Adam moments and step counts) and the index of
the parameter group each parameter belongs to. The module is pickled with its tensors replaced by references; the
tensors themselves go with batched ``torch.distributed`` point-to-point operations (GPU to GPU under NCCL), received
directly into the receiver's new tensors.

Migration is two-phase: every transfer completes and every receiver has rebuilt its layers before anyone commits;
only then do senders drop their copies and receivers install theirs, and the optimizers are updated in place (so LR
schedulers keep pointing at the same optimizer). Global layer order never changes: a plan is a new contiguous split.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from dynmo_lightning.optim import drop_params
from dynmo_lightning.pipeline.layers import LayerSlots
from dynmo_lightning.pipeline.layout import PipelineGroup
from dynmo_lightning.pipeline.runtime import StagePlan


@dataclasses.dataclass(frozen=True)
class Move:
    """Layers that go from pipeline rank ``src`` to pipeline rank ``dst``."""

    src: int
    dst: int
    layers: tuple[int, ...]


@dataclasses.dataclass
class MigrationStats:
    """What one migration did on this process."""

    moves: list[Move]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


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
# Serialisation: pickle with tensors by reference, tensor bytes in one flat buffer
# ---------------------------------------------------------------------------------------------------------------------
#: Tensors smaller than this travel together in one byte buffer; a message each would cost more than the copy.
_COALESCE_BELOW = 64 * 1024


class _Packer(pickle.Pickler):
    """Pickles objects with tensors on ``device`` replaced by references into :attr:`tensors` (shared ones once)."""

    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.device = device
        self.tensors: list[Tensor] = []
        self._keys: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor) or obj.device != self.device:
            return None  # e.g. Adam's CPU step counters under NCCL: pickled inline
        key = self._keys.get(id(obj))
        if key is None:
            key = self._keys[id(obj)] = len(self.tensors)
            self.tensors.append(obj.detach())
        return key, obj.requires_grad, isinstance(obj, nn.Parameter)


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._made: dict[int, Tensor] = {}

    def persistent_load(self, pid: Any) -> Tensor:
        key, requires_grad, is_param = pid
        if key not in self._made:
            t = self._tensors[key]
            self._made[key] = (
                nn.Parameter(t, requires_grad=requires_grad) if is_param else t.requires_grad_(requires_grad)
            )
        return self._made[key]


def _pack(obj: Any, device: torch.device) -> tuple[bytes, list[Tensor]]:
    """Pickle ``obj`` without its device tensors; returns the pickle and the tensors (contiguous) to send raw."""
    f = io.BytesIO()
    packer = _Packer(f, device)
    packer.dump(obj)
    return f.getvalue(), [t.contiguous() for t in packer.tensors]


def _unpack(blob: bytes, tensors: list[Tensor]) -> Any:
    return _Unpacker(io.BytesIO(blob), tensors).load()


#: Dtypes every torch.distributed backend transfers natively; others travel as their bytes.
_NATIVE = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
}


def _bytes(t: Tensor) -> Tensor:
    """A flat byte view of a contiguous tensor's memory."""
    return t.reshape(-1).view(torch.uint8)


def _wire(t: Tensor) -> Tensor:
    """The tensor as it goes over the wire (a byte view of the same memory for exotic dtypes)."""
    return t if t.dtype in _NATIVE else _bytes(t)


def _send_tensors(tensors: list[Tensor], peer: int, group: dist.ProcessGroup | None) -> None:
    """Large tensors go as messages of their own, small ones together in one byte buffer."""
    small = [_bytes(t) for t in tensors if t.numel() * t.element_size() < _COALESCE_BELOW]
    ops = [
        dist.P2POp(dist.isend, _wire(t), peer, group)
        for t in tensors
        if t.numel() * t.element_size() >= _COALESCE_BELOW
    ]
    if small:
        ops.append(dist.P2POp(dist.isend, torch.cat(small), peer, group))
    _exchange(ops)


def _recv_tensors(tensors: list[Tensor], peer: int, group: dist.ProcessGroup | None) -> None:
    """Receive into ``tensors`` (allocated by the caller) what :func:`_send_tensors` sent."""
    small = [t for t in tensors if t.numel() * t.element_size() < _COALESCE_BELOW]
    ops = [
        dist.P2POp(dist.irecv, _wire(t), peer, group)
        for t in tensors
        if t.numel() * t.element_size() >= _COALESCE_BELOW
    ]
    buffer = torch.empty(sum(t.numel() * t.element_size() for t in small), dtype=torch.uint8, device=tensors[0].device)
    if small:
        ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
    _exchange(ops)
    offset = 0
    for t in small:
        n = t.numel() * t.element_size()
        _bytes(t).copy_(buffer[offset : offset + n])
        offset += n


def _exchange(ops: list[dist.P2POp]) -> None:
    """Run point-to-point operations concurrently and wait for all of them."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


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


def _add_to_optimizers(layer: nn.Module, entries: dict[str, tuple[int, int, dict]], optimizers: Sequence[Optimizer]):
    params = dict(layer.named_parameters())
    for name, (o, g, state) in entries.items():
        p = params[name]
        group = optimizers[o].param_groups[g]["params"]
        if any(q is p for q in group):
            continue  # a parameter shared by layers that arrived together (a tie) is optimized once
        group.append(p)
        if state:
            optimizers[o].state[p] = state


def _send_layers(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    indices: Sequence[int],
    peer: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> int:
    """Send layers ``indices`` with their optimizer entries to global rank ``peer``; returns the bytes sent."""
    payload = {i: (slots.get(i), _optimizer_entries(slots.get(i), optimizers)) for i in indices}
    blob, tensors = _pack(payload, device)
    header = (blob, [(t.dtype, tuple(t.shape)) for t in tensors])
    dist.send_object_list([header], dst=peer, group=group, device=device if device.type == "cuda" else None)
    if tensors:
        _send_tensors(tensors, peer, group)
    return len(blob) + sum(t.numel() * t.element_size() for t in tensors)


def _recv_layers(
    peer: int, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[dict[int, tuple[nn.Module, dict]], int]:
    """Receive what :func:`_send_layers` sent: ``{index: (layer, optimizer entries)}`` and the bytes received."""
    header: list[Any] = [None]
    dist.recv_object_list(header, src=peer, group=group, device=device if device.type == "cuda" else None)
    blob, specs = header[0]
    # Large tensors are received straight into their final memory.
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    if tensors:
        _recv_tensors(tensors, peer, group)
    return _unpack(blob, tensors), len(blob) + sum(t.numel() * t.element_size() for t in tensors)


def _install(slots: LayerSlots, received: dict[int, tuple[nn.Module, dict]], optimizers: Sequence[Optimizer]) -> None:
    """Install received layers in layer order and add their parameters (with state) to the optimizers."""
    for i, (module, entries) in sorted(received.items()):
        slots.install(i, module)
        _add_to_optimizers(module, entries, optimizers)


def _commit_flag(ok: bool, device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether every process of ``group`` succeeded (phase one of a two-phase change)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def migrate(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    old: StagePlan,
    new: StagePlan,
    *,
    pipe: PipelineGroup,
    device: torch.device,
) -> MigrationStats:
    """Carry out ``old -> new`` on this process (collective over the pipeline group; every rank must call it).

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (updated in place).
        old: the current partition.
        new: the target partition.
        pipe: this process's pipeline (rank, group, members' global ranks).
        device: the device layers live on (and tensors travel on).

    Returns:
        The transfers and this process's bytes sent/received and wall time.

    Raises:
        RuntimeError: a transfer failed on some process; nothing was committed anywhere.
    """
    t0 = time.perf_counter()
    moves = plan_moves(old, new)
    stats = MigrationStats(moves)
    received: dict[int, tuple[nn.Module, dict]] = {}
    rank, group = pipe.rank, pipe.group
    ok = True
    error: BaseException | None = None
    for move in moves:
        if rank not in (move.src, move.dst):
            continue
        try:
            peer = pipe.global_rank(move.dst if rank == move.src else move.src)
            if rank == move.src:
                stats.bytes_sent += _send_layers(slots, optimizers, move.layers, peer, group, device)
            else:
                layers, size = _recv_layers(peer, group, device)
                received.update(layers)
                stats.bytes_received += size
        except Exception as e:
            ok, error = False, e
            break
    # Phase two: commit only if every process holds what it must.
    if not _commit_flag(ok, device, group):
        raise RuntimeError(
            f"layer migration {list(old.layers_per_stage)} -> {list(new.layers_per_stage)} failed on "
            f"{'this process' if not ok else 'another process'}; nothing was changed"
        ) from error
    leaving = {i for move in moves if rank == move.src for i in move.layers}
    staying = {id(p) for i in slots.local_indices() if i not in leaving for p in slots.get(i).parameters()}
    for i in sorted(leaving):
        # A parameter shared with a layer that stays (a tie) stays in the optimizer; the moving layer takes a copy.
        drop_params([p for p in slots.get(i).parameters() if id(p) not in staying], optimizers)
        slots.remove(i)
    _install(slots, received, optimizers)
    stats.seconds = time.perf_counter() - t0
    return stats


def replicate(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    copies: Sequence[tuple[int, int]],
    *,
    rank: int,
    device: torch.device,
) -> MigrationStats:
    """Copy every layer of each ``src`` to ``dst`` (global ranks), with optimizer state; collective over the world.

    A new data-parallel replica is made this way from a live one: the receiver must hold no layers; the sender keeps
    its own. Two-phase as :func:`migrate`: receivers install what they got only when every copy arrived everywhere.

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (receivers' are updated in place).
        copies: ``(src, dst)`` pairs of global ranks, the same list on every process.
        rank: this process's global rank.
        device: the device layers live on (and tensors travel on).
    """
    t0 = time.perf_counter()
    stats = MigrationStats(moves=[])
    received: dict[int, tuple[nn.Module, dict]] = {}
    receiving = any(rank == dst for _, dst in copies)
    # Checked by everyone before any transfer: a receiver that cannot take a copy must not leave its sender blocked.
    if not _commit_flag(not (receiving and slots.local_indices()), device, None):
        raise RuntimeError(
            f"copying layers to new replicas {list(copies)}: a receiving process still holds layers "
            f"({slots.local_indices() if receiving else 'on another process'}); nothing was changed"
        )
    ok, error = True, None
    try:
        for src, dst in copies:
            if rank == src:
                stats.bytes_sent += _send_layers(slots, optimizers, slots.local_indices(), dst, None, device)
            elif rank == dst:
                layers, size = _recv_layers(src, None, device)
                received.update(layers)
                stats.bytes_received += size
    except Exception as e:
        ok, error = False, e
    if not _commit_flag(ok, device, None):
        raise RuntimeError(
            f"copying layers to new replicas {list(copies)} failed on "
            f"{'this process' if not ok else 'another process'}; nothing was changed"
        ) from error
    _install(slots, received, optimizers)
    stats.seconds = time.perf_counter() - t0
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
    global_rank: int,
    device: torch.device,
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
        global_rank: this process's global rank.
        device: the device layers live on.
    """
    target = [0] * plan.n_ranks
    for stage, rank in enumerate(keep_ranks):
        target[rank] = layers_per_stage[stage]
    stats = migrate(slots, optimizers, plan, StagePlan(tuple(target), plan.n_ranks), pipe=pipe, device=device)
    if copies:
        copied = replicate(slots, optimizers, copies, rank=global_rank, device=device)
        stats.bytes_sent += copied.bytes_sent
        stats.bytes_received += copied.bytes_received
        stats.seconds += copied.seconds
    return stats
