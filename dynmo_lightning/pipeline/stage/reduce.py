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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dynmo_lightning.core.context import on_host
from dynmo_lightning.core.host_values import has_host_value, host_value, set_host_value
from dynmo_lightning.core.parts import held_parts, local_part
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.pipeline.topology.world import StageWorld
from dynmo_lightning.profiling import LayerCost, static_memory

if TYPE_CHECKING:
    from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding


def share_loss(loss: Tensor | None, pipe: PipelineGroup, last_rank: int) -> Tensor:
    """The last stage's loss on every process of the pipeline (``loss`` is ``None`` elsewhere), on ``pipe.device``."""
    out = loss.detach().float().clone() if loss is not None else torch.zeros((), device=pipe.device)
    out = out.to(pipe.device)
    dist.broadcast(out, src=pipe.global_rank(last_rank), group=pipe.group)
    return out


def average_loss(loss: Tensor, group: dist.ProcessGroup, n: int) -> None:
    """Average a (logged) loss over ``n`` replicas in place."""
    dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=group)
    loss.div_(n)


def sync_replica_buffers(
    slots: LayerSlots, group: dist.ProcessGroup, n: int, host_group: dist.ProcessGroup | None
) -> None:
    """Average the floating-point buffers that differ between replicas (exactly kept where they are equal).

    Dynamic layers adapt buffers to the data they see (e.g. a sparse attention's density): without this, the
    replicas would drift apart; with it they follow the mean, as one replica seeing the global batch would. Nothing
    is read on the host:

    - a scalar buffer whose value the host knows (``protocol.set_host_value``: thresholds, capacities, densities) is
      averaged on the host, over ``host_group`` (its CPU twin), and written back with its host value, so the next
      forward does not read it;
    - every other buffer goes in one all-gather over ``group`` (float64: exact for every floating dtype); min, max
      and sum over the replicas are taken on the device, in replica order, so every replica computes the same.
    """
    mirrored: list[tuple[nn.Module, str]] = []
    buffers: list[Tensor] = []
    for i in slots.local_indices():
        for module in slots.get(i).modules():
            for name, t in module.named_buffers(recurse=False):
                if t is None or not t.is_floating_point() or name in module._non_persistent_buffers_set:
                    continue
                if has_host_value(module, name):
                    mirrored.append((module, name))
                else:
                    buffers.append(t)
    if mirrored:
        _average_host_values(mirrored, host_group, n)
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
    every = flat.new_empty(n * flat.numel())  # gloo takes the flat layout only
    dist.all_gather_into_tensor(every, flat, group=group)
    every = every.view(n, -1)
    merged = torch.where(every.amin(0) == every.amax(0), flat, every.sum(0) / n)
    with torch.no_grad():
        start = 0
        for b in buffers:
            b.copy_(merged[start : start + b.numel()].view_as(b))
            start += b.numel()


def _average_host_values(mirrored: list[tuple[nn.Module, str]], group: dist.ProcessGroup | None, n: int) -> None:
    """Host-known scalar buffers: the replicas' values gathered on the host, averaged where they differ."""
    mine = [host_value(module, name) for module, name in mirrored]
    every: list[Any] = [None] * n
    with on_host():
        dist.all_gather_object(every, mine, group=group)
    for k, (module, name) in enumerate(mirrored):
        values = [part[k] for part in every]
        if min(values) != max(values):
            set_host_value(module, name, math.fsum(values) / n)  # the same float on every replica


def replicas_in_sync(state: dict[str, Tensor], dp_group: dist.ProcessGroup | None, dp_size: int, device: Any) -> bool:
    """Whether every replica holds a bit-identical ``state`` (collective over the whole job).

    ``dp_group`` is the replicas' CPU group (the digests are host data). A tensor sharded over the replicas
    (FSDP2) has one copy, split: only what each replica holds whole is compared.
    """
    ok = True
    if dp_group is not None:
        digest = hashlib.sha256()
        for name, t in sorted(state.items()):
            if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements):
                continue
            digest.update(name.encode())
            t = local_part(t)
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        found: list[Any] = [None] * dp_size
        dist.all_gather_object(found, digest.hexdigest(), group=dp_group)
        ok = len(set(found)) == 1
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def held_share(p: Tensor, holders: int) -> float:
    """The weight of a process's part of ``p`` in a sum over the ``holders`` processes of its stage.

    The stage's ``holders`` processes (its replicas times its tensor-parallel processes) hold ``p`` in
    :func:`~dynmo_lightning.protocol.held_parts` distinct parts, each part on ``holders / parts`` of them: a sum over
    the ``holders`` of every process's part times ``parts / holders`` counts every element once.
    """
    return held_parts(p) / holders


def param_norm(
    named: Sequence[tuple[str, Tensor]],
    counted: Callable[[str], bool],
    pipe: PipelineGroup,
    shards: Sequence[dist.ProcessGroup] = (),
    holders: int = 1,
) -> float:
    """L2 norm (float64) of the whole model's parameters, each stage summing its own (collective over the pipeline).

    Args:
        named: this stage's ``(name, parameter)``.
        counted: whether this stage counts a parameter (a tied one is counted by one of its owners only).
        pipe: the pipeline (the sum is reduced on its device).
        shards: the groups over which the ``holders`` processes of each stage hold parts of its parameters (FSDP2's
            replicas, the tensor-parallel group): each part weighted by :func:`held_share`, summed over them too.
        holders: processes holding each stage (in ``shards``).
    """
    sq = torch.zeros((), dtype=torch.float64, device=pipe.device)
    for name, p in named:
        if counted(name):
            part = local_part(p).detach().to(torch.float64).square().sum()
            sq += part * held_share(p, holders) if shards else part
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pipe.group)
    for group in shards:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return math.sqrt(float(sq))


@dataclasses.dataclass
class GlobalNormClipping:
    """Clip gradients by the norm of *all* stages' gradients, exactly as the unsplit model's clipping would.

    ``torch.nn.utils.clip_grad_norm_`` takes the norm of the per-parameter norms in optimizer order. Each stage
    computes its per-parameter norms the same way and writes them into one tensor at their slots in the unsplit model's
    order (group, then parameter position); one all-reduce (a sum) of that tensor gives every stage all the norms,
    which it picks out in that order, so the clip coefficient is bit-identical to one process. A tied parameter's
    copies hold the same gradient and norm: the sum of ``k`` copies divided by ``k`` is exactly it.

    Which slots are filled (and by how many copies) is host data: every stage knows its own, and their sum goes over
    the pipeline's CPU control group (``pipe.control``), so picking the norms out needs no read of the device. The
    index tensors on the device are made once per layout (the filled slots), not every step: in steady state a
    clipping step neither copies from the host nor synchronises the device.

    Gradients held in parts (FSDP2 shards them over the replicas, tensor parallelism splits layers over the
    processes of a stage) enter as their squared norms, each weighted by its share (:func:`held_share`: a part
    every one of ``holders`` processes of the stage holds alike counts ``1 / holders``), and the table is summed
    over the whole job instead of the pipeline: still one collective, and every slot then holds the square of the
    whole gradient's norm (of its copies' sum, for a tie).

    The global norm before clipping is kept, on the device, as :attr:`last_norm` (every process of the job holds the
    same value): what ``clip_grad_norm_`` of the unsplit model returns, for the run summary to read after training
    (reading it in the step would wait for the device).

    Attributes:
        param_order: names of all parameters of the unsplit model, in its order.
        names: returns ``id(param) -> name`` in the unsplit model (a tie's copies share the canonical name).
        world: the world in force (the ``World``): this process's pipeline (its groups and device), and the
            processes holding each stage (replicas times tensor-parallel processes) when ``sharded``; both change
            when the world does.
        sharded: whether gradients are held in parts (``data_parallel="fsdp"``, or tensor parallelism).
        last_norm: the global gradient norm before the last call clipped (a new 0-d tensor on the pipeline's device
            every call), ``None`` before the first call.
    """

    param_order: list[str]
    names: Callable[[], dict[int, str]]
    world: StageWorld
    sharded: bool = False
    last_norm: Tensor | None = dataclasses.field(default=None, init=False)
    _local: dict[tuple[tuple[int, ...], torch.device], Tensor] = dataclasses.field(default_factory=dict, repr=False)
    _global: dict[bytes, tuple[Tensor, Tensor | None]] = dataclasses.field(default_factory=dict, repr=False)
    _weights: dict[tuple[tuple[float, ...], torch.device], Tensor] = dataclasses.field(default_factory=dict, repr=False)

    def __call__(self, optimizer: Optimizer, clip_val: float) -> None:
        """Scale the local gradients of ``optimizer`` so the global norm is at most ``clip_val``."""
        trainable, slots = self._trainable_slots(optimizer)
        params = [p for p in trainable if p.grad is not None]
        size = len(optimizer.param_groups) * len(self.param_order)
        pipe = self.world.pipeline
        device = pipe.device
        table = self._local_table(trainable, slots, size, device, bool(params))
        # on an accelerator, runs while the host sums which slots are filled (below)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=None if self.sharded else pipe.group)
        copies = self._copies(slots, size, pipe)
        # A stage without gradients (frozen layers) still knows the global norm: every process keeps the same value.
        dtype = params[0].grad.dtype if params else trainable[0].dtype if trainable else torch.get_default_dtype()
        self.last_norm = total = self._total_norm(table, copies, device, dtype)
        if params:
            self._clip(params, clip_val, total)

    def _trainable_slots(self, optimizer: Optimizer) -> tuple[list[Tensor], list[int]]:
        """The trainable parameters of ``optimizer`` in its order, and each one's slot in the unsplit model's table.

        Args:
            optimizer: the optimizer whose parameter groups are clipped.

        Returns:
            The trainable parameters and their slots (``group * len(param_order) + position``).
        """
        position = {name: i for i, name in enumerate(self.param_order)}
        names, n = self.names(), len(self.param_order)
        # A slot per trainable parameter (a layout changes only when layers freeze, move or are pruned); one whose
        # gradient is None this step (an MoE expert that got no token, on the per-expert path) adds a zero norm:
        # the same sum as torch's, which leaves it out.
        trainable: list[Tensor] = []
        slots: list[int] = []
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    trainable.append(p)
                    slots.append(g * n + position[names[id(p)]])
        return trainable, slots

    def _local_table(
        self, trainable: list[Tensor], slots: list[int], size: int, device: torch.device, has_grads: bool
    ) -> Tensor:
        """This stage's table of norms (squared and weighted when ``sharded``), zero outside its slots.

        Args:
            trainable: this stage's trainable parameters, in optimizer order.
            slots: their slots in the table.
            size: slots of the table (parameter groups times the unsplit model's parameters).
            device: where the table lives (the pipeline's device).
            has_grads: whether any of ``trainable`` has a gradient (else the table stays zero).

        Returns:
            The float64 table, to be summed over the pipeline (or the job, when ``sharded``).
        """
        # float64 holds any float32 norm, and k times it, exactly.
        table = torch.zeros(size, dtype=torch.float64, device=device)
        if has_grads:
            norms = self._norms(trainable, device)
            if self.sharded:
                norms = norms.square()
                shares = tuple(held_share(p, self.world.holders) for p in trainable)
                if any(share != 1.0 for share in shares):  # parts some processes hold alike (tensor parallelism)
                    norms = norms * self._shares(shares, device)
            table.index_copy_(0, self._device_index(tuple(slots), device), norms)
        return table

    def _total_norm(self, table: Tensor, copies: Any, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The global norm from the summed table: the filled slots in order, each divided by its copies.

        Args:
            table: the table summed over the stages (squared norms when ``sharded``).
            copies: how many stages filled each slot (:meth:`_copies`).
            device: the table's device.
            dtype: the gradients' dtype (the norm of the norms is taken in it, as torch does).

        Returns:
            The total norm, as ``clip_grad_norm_`` of the unsplit model computes it.
        """
        present, k = self._present(copies, device)
        ordered = table.index_select(0, present)
        if k is not None:
            ordered = ordered / k  # a tie's copies hold the same norm: their sum over k is exactly it
        if self.sharded:
            ordered = ordered.sqrt()
        return torch.linalg.vector_norm(ordered.to(dtype), 2.0)

    @staticmethod
    def _clip(params: list[Tensor], clip_val: float, total: Tensor) -> None:
        """Scale the gradients of ``params`` by torch's clip coefficient for the global norm ``total``.

        Args:
            params: the parameters with a gradient.
            clip_val: the largest global norm allowed.
            total: the global norm (:meth:`_total_norm`).
        """
        if not any(isinstance(p.grad, DTensor) for p in params):
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)
            return
        # torch's clip_grads_with_norm_ on the local parts (a DTensor times a plain tensor is refused), per dtype
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(local_part(p.grad))
        for grads in by_dtype.values():
            torch._foreach_mul_(grads, coef.to(grads[0].device, grads[0].dtype))

    @staticmethod
    def _norms(trainable: list[Tensor], device: torch.device) -> Tensor:
        """Every trainable parameter's gradient norm (0 without a gradient), as float64, computed as torch does."""
        grads = [local_part(p.grad) for p in trainable if p.grad is not None]
        if grads[0].device.type == "cpu":
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]  # torch's own CPU path
        else:
            norms = list(torch._foreach_norm(grads, 2.0))
        if len(grads) < len(trainable):
            found = iter(norms)
            zero = torch.zeros((), dtype=norms[0].dtype, device=norms[0].device)
            norms = [next(found) if p.grad is not None else zero for p in trainable]
        return torch.stack(norms).to(torch.float64)

    def _device_index(self, slots: tuple[int, ...], device: torch.device) -> Tensor:
        """This stage's slots as an index on ``device``, made once per set of slots."""
        return _on_device(self._local, slots, torch.long, device)

    def _shares(self, shares: tuple[float, ...], device: torch.device) -> Tensor:
        """The parameters' :func:`held_share` on ``device``, made once per layout (no copy from the host per step)."""
        return _on_device(self._weights, shares, torch.float64, device)

    def _copies(self, slots: list[int], size: int, pipe: PipelineGroup) -> Any:
        """How many stages fill each slot (a NumPy array): the stages' slots summed over the host group."""
        filled = torch.zeros(size, dtype=torch.int32)  # host data, summed on the CPU group
        if slots:
            filled.index_fill_(0, self._device_index(tuple(slots), torch.device("cpu")), 1)
        dist.all_reduce(filled, op=dist.ReduceOp.SUM, group=pipe.control)
        return filled.numpy()

    def _present(self, copies: Any, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """The filled slots in order, and their copy counts where any slot has several (``None``: one each)."""
        key = copies.tobytes()
        if key not in self._global:
            self._global.clear()
            present = copies.nonzero()[0]
            k = copies[present]
            counts = torch.tensor(k.tolist(), dtype=torch.float64, device=device) if (k > 1).any() else None
            self._global[key] = (torch.tensor(present.tolist(), dtype=torch.long, device=device), counts)
        return self._global[key]


def gather_costs(
    local: dict[int, LayerCost],
    slots: LayerSlots,
    optimizer: Optimizer | None,
    pipe: PipelineGroup,
    replicas: tuple[dist.ProcessGroup, int] | None = None,
    sharding: StageSharding | None = None,
    probe_s: float | None = None,
) -> dict[int, dict[str, float]]:
    """Every layer's measured costs and memory, on every process (collective over the pipeline and its replicas).

    Args:
        local: this process's :meth:`~dynmo_lightning.profiling.LayerProfiler.stop`.
        slots: the layers of this process.
        optimizer: the optimizer whose state counts as the layers' optimizer memory.
        pipe: the pipeline.
        replicas: ``(group, size)`` of this stage's replicas (``group``: their CPU group: the costs are host data),
            whose measurements (of different data: routing, exits) are averaged in replica order, so that every
            process of the job plans from the same numbers.
        sharding: how the stage holds its layers; the gradients and gathered weights a step holds follow it
            (:meth:`~dynmo_lightning.pipeline.parallel.data_parallel.StageSharding.step_bytes`; ``None``: this process's
            gradients).
        probe_s: this process's calibration kernel time of the step
            (:func:`~dynmo_lightning.profiling.calibration_seconds`): every layer then carries it as ``probe_s``
            with its ``pp_rank``, and across replicas each time is averaged as a multiple of its own process's
            kernel time and carried at the slowest replica's kernel time (the gradient sync makes every replica
            wait for the slowest).
    """
    mine = {}
    for i, cost in local.items():
        layer = slots.get(i)
        params, grads, optim = static_memory(layer, optimizer)
        mine[i] = {**dataclasses.asdict(cost), "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim}
        if sharding is not None:
            mine[i] |= sharding.step_bytes(layer)
        if probe_s is not None:
            mine[i] |= {"probe_s": probe_s, "pp_rank": float(pipe.rank)}
    parts: list[Any] = [None] * pipe.size
    with on_host():  # host data: on the CPU group
        dist.all_gather_object(parts, mine, group=pipe.control)
    costs = {i: v for part in parts for i, v in part.items()}
    if replicas is not None:
        group, n = replicas
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, costs, group=group)
        costs = {i: _across_replicas([r[i] for r in gathered]) for i in sorted(costs)}
    return costs


#: Measured times: across replicas they are averaged in units of each process's calibration kernel time.
_TIMES = ("fwd", "bwd", "bwd_weight")


def _across_replicas(rows: list[dict[str, float]]) -> dict[str, float]:
    """One layer's measurements of its replicas as one: means, times at the slowest replica's speed."""
    n = len(rows)
    out = {k: sum(r[k] for r in rows) / n for k in rows[0]}
    if all(r.get("probe_s", 0) > 0 for r in rows):
        slowest = max(r["probe_s"] for r in rows)
        for k in _TIMES:
            if k in out:
                out[k] = slowest * sum(r[k] / r["probe_s"] for r in rows) / n
        out["probe_s"], out["pp_rank"] = slowest, rows[0]["pp_rank"]
    return out


def _on_device(cache: dict[tuple[tuple[Any, ...], torch.device], Tensor], values: tuple[Any, ...], dtype: torch.dtype,
               device: torch.device) -> Tensor:  # fmt: skip
    """``values`` as a tensor on ``device``, copied from the host once per layout (``cache`` holds one layout)."""
    key = (values, device)
    if key not in cache:
        if any(v != values for v, _ in cache):
            cache.clear()  # one layout at a time
        cache[key] = torch.tensor(values, dtype=dtype, device=device)
    return cache[key]
