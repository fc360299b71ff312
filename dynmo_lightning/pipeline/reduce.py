"""Reductions over the stages of a pipeline and over its data-parallel replicas.

Each stage holds only its own layers, so every quantity of the whole model is a collective: the loss (on the last
stage, shared with all), the gradient norm for clipping and the parameter norm (summed over stages, tied parameters
once), the layer costs the balancer plans from (gathered from every stage, averaged over replicas). Replicas train
on different data: logged losses and the buffers layers adapt to their data are averaged over them here (gradients
are averaged by DDP during the last micro-batch's backward, see ``PipelineRuntime``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from dynmo_lightning.pipeline.layers import LayerSlots
from dynmo_lightning.pipeline.layout import PipelineGroup
from dynmo_lightning.profiling import LayerCost, static_memory


def share_loss(loss: Tensor | None, pipe: PipelineGroup, last_rank: int, device: torch.device) -> Tensor:
    """The last stage's loss on every process of the pipeline (``loss`` is ``None`` elsewhere)."""
    out = loss.detach().float().clone() if loss is not None else torch.zeros((), device=device)
    out = out.to(device)
    dist.broadcast(out, src=pipe.global_rank(last_rank), group=pipe.group)
    return out


def average_loss(loss: Tensor, group: dist.ProcessGroup, n: int) -> None:
    """Average a (logged) loss over ``n`` replicas in place."""
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
    loss.div_(n)


def sync_replica_buffers(slots: LayerSlots, group: dist.ProcessGroup, n: int) -> None:
    """Average the floating-point buffers that differ between replicas (exactly kept where they are equal).

    Dynamic layers adapt buffers to the data they see (e.g. a sparse attention's density): without this, the
    replicas would drift apart; with it they follow the mean, as one replica seeing the global batch would.
    """
    buffers = [
        t
        for i in slots.local_indices()
        for t in slots.get(i).state_dict(keep_vars=True).values()
        if not isinstance(t, nn.Parameter) and t.is_floating_point()
    ]
    if not buffers:
        return
    flat = torch._utils._flatten_dense_tensors([b.detach() for b in buffers]).float()
    low, high, total = flat.clone(), flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if torch.equal(low, high):
        return
    merged = torch.where(low == high, flat, total / n)
    with torch.no_grad():
        for b, value in zip(buffers, torch._utils._unflatten_dense_tensors(merged, buffers), strict=True):
            b.copy_(value.to(b.dtype))


def replicas_in_sync(state: dict[str, Tensor], dp_group: dist.ProcessGroup | None, dp_size: int, device: Any) -> bool:
    """Whether every replica holds a bit-identical ``state`` (collective over the whole job)."""
    ok = True
    if dp_group is not None:
        digest = hashlib.sha256()
        for name, t in sorted(state.items()):
            digest.update(name.encode())
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        found: list[Any] = [None] * dp_size
        dist.all_gather_object(found, digest.hexdigest(), group=dp_group)
        ok = len(set(found)) == 1
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def param_norm(
    named: Sequence[tuple[str, Tensor]], counted: Callable[[str], bool], pipe: PipelineGroup, device: torch.device
) -> float:
    """L2 norm (float64) of the whole model's parameters, each stage summing its own (collective over the pipeline).

    Args:
        named: this stage's ``(name, parameter)``.
        counted: whether this stage counts a parameter (a tied one is counted by one of its owners only).
        pipe: the pipeline.
        device: where the sum is reduced.
    """
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for name, p in named:
        if counted(name):
            sq += p.detach().to(torch.float64).square().sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pipe.group)
    return math.sqrt(float(sq))


@dataclasses.dataclass
class GlobalNormClipping:
    """Clip gradients by the norm of *all* stages' gradients, exactly as the unsplit model's clipping would.

    ``torch.nn.utils.clip_grad_norm_`` takes the norm of the per-parameter norms in optimizer order. Each stage
    computes its per-parameter norms the same way and writes them into one tensor at their slots in the unsplit model's
    order (group, then parameter position), with a presence flag; one all-reduce (a sum) of that tensor gives every
    stage all the norms, which it stacks in that order, so the clip coefficient is bit-identical to one process. A
    tied parameter's copies hold the same gradient and norm: the sum of ``k`` copies divided by ``k`` is exactly it.

    Attributes:
        param_order: names of all parameters of the unsplit model, in its order.
        names: returns ``id(param) -> name`` in the unsplit model (a tie's copies share the canonical name).
        pipe: returns this process's pipeline (it changes when the world shrinks).
        device: returns the device collectives of this process run on.
    """

    param_order: list[str]
    names: Callable[[], dict[int, str]]
    pipe: Callable[[], PipelineGroup]
    device: Callable[[], torch.device] = lambda: torch.device("cpu")

    def __call__(self, optimizer: Optimizer, clip_val: float) -> None:
        """Scale the local gradients of ``optimizer`` so the global norm is at most ``clip_val``."""
        position = {name: i for i, name in enumerate(self.param_order)}
        names, n = self.names(), len(self.param_order)
        params, slots = [], []
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    slots.append(g * n + position[names[id(p)]])
        grads = [p.grad for p in params]
        if grads and grads[0].device.type == "cpu":
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]  # torch's own CPU path
        else:
            norms = list(torch._foreach_norm(grads, 2.0)) if grads else []
        # Row 0: the norms at their slots (float64 holds any float32 norm, and k times it, exactly); row 1: copies.
        table = torch.zeros(2, len(optimizer.param_groups) * n, dtype=torch.float64, device=self.device())
        if slots:
            index = torch.tensor(slots, device=table.device)
            table[0, index] = torch.stack(norms).to(table.device, torch.float64)
            table[1, index] = 1.0
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.pipe().group)
        if not params:
            return
        present = table[1] > 0
        ordered = (table[0, present] / table[1, present]).to(grads[0].dtype).to(grads[0].device)
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, torch.linalg.vector_norm(ordered, 2.0))


def gather_costs(
    local: dict[int, LayerCost],
    slots: LayerSlots,
    optimizer: Optimizer | None,
    pipe: PipelineGroup,
    replicas: tuple[dist.ProcessGroup, int] | None = None,
) -> dict[int, dict[str, float]]:
    """Every layer's measured costs and memory, on every process (collective over the pipeline and its replicas).

    Args:
        local: this process's :meth:`~dynmo_lightning.profiling.LayerProfiler.stop`.
        slots: the layers of this process.
        optimizer: the optimizer whose state counts as the layers' optimizer memory.
        pipe: the pipeline.
        replicas: ``(group, size)`` of this stage's replicas, whose measurements (of different data: routing,
            exits) are averaged in replica order, so that every process of the job plans from the same numbers.
    """
    mine = {}
    for i, cost in local.items():
        params, grads, optim = static_memory(slots.get(i), optimizer)
        mine[i] = {**dataclasses.asdict(cost), "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim}
    parts: list[Any] = [None] * pipe.size
    dist.all_gather_object(parts, mine, group=pipe.group)
    costs = {i: v for part in parts for i, v in part.items()}
    if replicas is not None:
        group, n = replicas
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, costs, group=group)
        costs = {i: {k: sum(r[i][k] for r in gathered) / n for k in costs[i]} for i in sorted(costs)}
    return costs


def last_stage_perplexity(has_last_stage: bool, device: torch.device) -> Any:
    """A torchmetrics ``Perplexity`` that only the last stage updates (the others add nothing to its sums)."""
    from torchmetrics.text import Perplexity

    if not has_last_stage:
        # Expected here: this process contributes zero counts and never calls `update`.
        warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric Perplexity")
    return Perplexity().to(device)
