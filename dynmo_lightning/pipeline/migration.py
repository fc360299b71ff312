"""Move pipeline layers between processes with everything that defines them.

A layer travels as the module object itself, so parameters, buffers, ``requires_grad`` flags, shapes (a pruned layer
arrives pruned) and any dynamic state a layer keeps in its attributes (masks, routers, thresholds, flags) all move
with it, together with the optimizer state of its parameters (e.g. Adam moments and step counts) and the index of
the parameter group each parameter belongs to. The module is pickled with its tensors replaced by references; the
tensors go as one raw byte buffer per transfer with ``torch.distributed`` point-to-point (on the GPU under NCCL).

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

from dynmo_lightning.pipeline.layers import LayerSlots
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
class _Packer(pickle.Pickler):
    """Pickles objects with tensors on ``device`` replaced by references into :attr:`tensors` (shared ones once)."""

    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.device = device
        self.tensors: list[Tensor] = []
        self._keys: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor) or obj.device != self.device:
            return None  # small CPU tensors (e.g. Adam's step under NCCL) are pickled inline
        key = self._keys.get(id(obj))
        if key is None:
            key = self._keys[id(obj)] = len(self.tensors)
            self.tensors.append(obj.detach())
        meta = (key, obj.dtype, tuple(obj.shape), obj.requires_grad, isinstance(obj, nn.Parameter))
        return meta


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors
        self._made: dict[int, Tensor] = {}

    def persistent_load(self, pid: Any) -> Tensor:
        key, _, _, requires_grad, is_param = pid
        if key not in self._made:
            t = self._tensors[key]
            self._made[key] = (
                nn.Parameter(t, requires_grad=requires_grad) if is_param else t.requires_grad_(requires_grad)
            )
        return self._made[key]


def _pack(obj: Any, device: torch.device) -> tuple[bytes, list[tuple[torch.dtype, tuple[int, ...]]], Tensor]:
    f = io.BytesIO()
    packer = _Packer(f, device)
    packer.dump(obj)
    specs = [(t.dtype, tuple(t.shape)) for t in packer.tensors]
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in packer.tensors]
    buffer = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    return f.getvalue(), specs, buffer


def _unpack(blob: bytes, specs: list[tuple[torch.dtype, tuple[int, ...]]], buffer: Tensor) -> Any:
    tensors, offset = [], 0
    for dtype, shape in specs:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # clone: every tensor gets its own storage, freed independently when its layer later moves on
        tensors.append(buffer[offset : offset + n].clone().view(dtype).reshape(shape))
        offset += n
    return _Unpacker(io.BytesIO(blob), tensors).load()


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


def _drop_from_optimizers(layer: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    ids = {id(p) for p in layer.parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for p in list(opt.state):
            if id(p) in ids:
                del opt.state[p]


def _add_to_optimizers(layer: nn.Module, entries: dict[str, tuple[int, int, dict]], optimizers: Sequence[Optimizer]):
    params = dict(layer.named_parameters())
    for name, (o, g, state) in entries.items():
        p = params[name]
        optimizers[o].param_groups[g]["params"].append(p)
        if state:
            optimizers[o].state[p] = state


def migrate(
    slots: LayerSlots,
    optimizers: Sequence[Optimizer],
    old: StagePlan,
    new: StagePlan,
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> MigrationStats:
    """Carry out ``old -> new`` on this process (collective over the pipeline group; every rank must call it).

    Args:
        slots: the model's layers on this process.
        optimizers: the optimizers holding the local parameters (updated in place).
        old: the current partition.
        new: the target partition.
        rank: this process's pipeline rank.
        group: the pipeline process group.
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
    object_device = device if device.type == "cuda" else None

    def global_rank(pp_rank: int) -> int:
        return dist.get_global_rank(group, pp_rank) if group is not None else pp_rank

    ok = True
    error: BaseException | None = None
    for move in moves:
        if rank not in (move.src, move.dst):
            continue
        try:
            if rank == move.src:
                payload = {i: (slots.get(i), _optimizer_entries(slots.get(i), optimizers)) for i in move.layers}
                blob, specs, buffer = _pack(payload, device)
                dist.send_object_list(
                    [(blob, specs, buffer.numel())], dst=global_rank(move.dst), group=group, device=object_device
                )
                if buffer.numel():
                    dist.send(buffer, dst=global_rank(move.dst), group=group)
                stats.bytes_sent += len(blob) + buffer.numel()
            else:
                header: list[Any] = [None]
                dist.recv_object_list(header, src=global_rank(move.src), group=group, device=object_device)
                blob, specs, n = header[0]
                buffer = torch.empty(n, dtype=torch.uint8, device=device)
                if n:
                    dist.recv(buffer, src=global_rank(move.src), group=group)
                received.update(_unpack(blob, specs, buffer))
                stats.bytes_received += len(blob) + n
        except Exception as e:
            ok, error = False, e
            break
    # Phase two: commit only if every process holds what it must.
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not bool(flag.item()):
        raise RuntimeError(
            f"layer migration {list(old.layers_per_stage)} -> {list(new.layers_per_stage)} failed on "
            f"{'this process' if not ok else 'another process'}; nothing was changed"
        ) from error
    for move in moves:
        if rank == move.src:
            for i in move.layers:
                _drop_from_optimizers(slots.get(i), optimizers)
                slots.remove(i)
    for i, (module, entries) in sorted(received.items()):
        slots.install(i, module)
        _add_to_optimizers(module, entries, optimizers)
    stats.seconds = time.perf_counter() - t0
    return stats
