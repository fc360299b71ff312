"""Host data and tensors between the processes of a pipeline: how migration and the shape probe talk.

Headers (pickled host data: a layer's pickle, tensor shapes and dtypes) and agreement flags go over the pipeline's
CPU control group (gloo, :attr:`~dynmo_lightning.pipeline.topology.mesh.PipelineGroup.control`): there a message is a
host copy. Over NCCL an object would be staged on the GPU and back, and an un-batched NCCL send opens a two-rank
communicator for every new pair of processes that is never freed. Tensors go with batched point-to-point operations on
the pipeline's group, on its device (GPU to GPU under NCCL; batched, they use the group's own communicator), straight
into the receiver's memory: large ones as messages of their own, small ones together in one byte buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dynmo_lightning.core.context import on_host
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup, group_device
from dynmo_lightning.profiling import DeviceClock

#: Tensors smaller than this travel together in one byte buffer; a message each would cost more than the copy.
COALESCE_BELOW = 64 * 1024

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


def send_header(obj: Any, peer: int, pipe: PipelineGroup) -> None:
    """Send picklable host data to global rank ``peer`` over the control group."""
    with on_host():
        dist.send_object_list([obj], dst=peer, group=pipe.control)


def recv_header(peer: int, pipe: PipelineGroup) -> Any:
    """Receive what :func:`send_header` sent from global rank ``peer``."""
    box: list[Any] = [None]
    with on_host():
        dist.recv_object_list(box, src=peer, group=pipe.control)
    return box[0]


def all_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether every process of the CPU ``group`` says ``ok`` (phase one of a two-phase change; collective)."""
    with on_host():
        flag = torch.tensor([1 if ok else 0], device=group_device(torch.device("cpu"), group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(t: Tensor) -> Tensor:
    """A flat byte view of a contiguous tensor's memory."""
    return t.reshape(-1).view(torch.uint8)


def _wire(t: Tensor) -> Tensor:
    """The tensor as it goes over the wire (a byte view of the same memory for exotic dtypes)."""
    return t if t.dtype in _NATIVE else _bytes(t)


def send_tensors(tensors: Sequence[Tensor], peer: int, pipe: PipelineGroup) -> None:
    """Send contiguous ``tensors`` (on :attr:`PipelineGroup.device`) to global rank ``peer``."""
    small = [_bytes(t) for t in tensors if _nbytes(t) < COALESCE_BELOW]
    ops = [dist.P2POp(dist.isend, _wire(t), peer, pipe.group) for t in tensors if _nbytes(t) >= COALESCE_BELOW]
    if small:
        ops.append(dist.P2POp(dist.isend, torch.cat(small), peer, pipe.group))
    _exchange(ops)


def recv_tensors(tensors: Sequence[Tensor], peer: int, pipe: PipelineGroup) -> None:
    """Receive into ``tensors`` (allocated by the caller, contiguous) what :func:`send_tensors` sent."""
    small = [t for t in tensors if _nbytes(t) < COALESCE_BELOW]
    ops = [dist.P2POp(dist.irecv, _wire(t), peer, pipe.group) for t in tensors if _nbytes(t) >= COALESCE_BELOW]
    buffer = torch.empty(sum(_nbytes(t) for t in small), dtype=torch.uint8, device=pipe.device)
    if small:
        ops.append(dist.P2POp(dist.irecv, buffer, peer, pipe.group))
    _exchange(ops)
    offset = 0
    for t in small:
        _bytes(t).copy_(buffer[offset : offset + _nbytes(t)])
        offset += _nbytes(t)


def open_link(peer: int, pipe: PipelineGroup, clock: DeviceClock) -> float:
    """Open the device link to global rank ``peer`` on the pipeline's group; the seconds it took (0 if open).

    NCCL connects a pair of ranks on their first transfer; a migration that timed that set-up would teach the
    balancer's bandwidth estimate a one-off cost. Both peers call this before their first transfer (they take part
    in the same transfers, so they agree on which one is first) and exchange one byte each way.
    """
    if peer in pipe.links:
        return 0.0
    out = torch.zeros(1, dtype=torch.uint8, device=pipe.device)
    back = torch.empty_like(out)
    start = clock.now()
    _exchange([dist.P2POp(dist.isend, out, peer, pipe.group), dist.P2POp(dist.irecv, back, peer, pipe.group)])
    seconds = clock.elapsed(start, clock.now())
    pipe.links.add(peer)
    return seconds


def _exchange(ops: list[dist.P2POp]) -> None:
    """Run point-to-point operations concurrently and wait for all of them."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
