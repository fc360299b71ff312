"""Tensor parallelism inside every stage: each pipeline layer split over the ``T`` processes of its stage.

``DynMoStrategy(tensor_parallel_size=T)`` adds a ``"tp"`` dimension to the job's mesh, innermost (the fastest
links, as torchtitan and Megatron place it): the ``T`` processes of a stage hold one part each of its layers, see
the same batch, and run side by side as ``T`` pipelines, process ``(p, t)`` sending its activations to ``(p + 1,
t)``. A layer is split with torch's ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``: DTensor
parameters whose local part is this process's) by

1. the module's hook ``pipeline_parallelize_layer(index, layer, tp_mesh)`` when it has one (the user's plan, the
   convention of Lightning's ``ModelParallelStrategy``), or
2. the built-in plan of the layer's type (:func:`builtin_plan`): the reference GPT's :class:`~dynmo_lightning.models.
   blocks.Block` (attention heads: ``q``/``k``/``v`` by rows, ``proj`` by columns; MLP: ``fc`` by rows, ``proj`` by
   columns) and the Hugging Face decoder layers (Llama, Mistral, Qwen2: attention and gated MLP as torchtitan's
   Llama plan; GPT-2: the MLP, whose fused ``c_attn`` keeps its attention whole: its columns are ``[q | k | v]``, and
   only a strided layout, which DCP cannot checkpoint, would give each process whole heads).

Every split block takes and returns whole (replicated) hidden states: what travels between stages is what travels
without tensor parallelism. A layer no plan splits runs whole on every process of its stage (the embedding and the
head, an MoE layer's experts, a sparse attention whose density adapts to all heads at once).

Whatever no plan splits is held whole by every process of the stage (or, under FSDP2, the same replica shard by
each), and its gradient is computed by each of them from the same data: equal in exact arithmetic, not in bits where
CUDA kernels accumulate in a nondeterministic order (``index_add_``, an embedding's backward). Once per step, after
the backward and before clipping, those gradients are averaged over the tensor-parallel group
(:func:`average_replicated_grads`), so the copies never drift apart.

A layer is split once where it is built (:meth:`TensorParallel.split`), in torchtitan's order: tensor parallel,
then compile, then FSDP2. A layer that migrates travels as its local parts (each process sends its part to the
process of the same tensor-parallel rank on the receiving stage), arrives as a meta-device layer, is split again by
the same plan on the meta device and filled with the parts that came (``StageSharding.adopt``): no process ever
holds a moving layer whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from dynmo_lightning.core.parts import local_part
from dynmo_lightning.models.blocks import MLP, Block, CausalSelfAttention
from dynmo_lightning.pipeline.topology.world import StageWorld

#: The module hook that splits a layer (``(index, layer, tp_mesh) -> None``, in place).
HOOK = "pipeline_parallelize_layer"

#: A plan: ``{submodule path: style}`` for ``parallelize_module``, or ``{}`` (the layer runs whole).
Plan = dict[str, ParallelStyle]


def is_split(layer: nn.Module) -> bool:
    """Whether some parameter of ``layer`` is a DTensor split over the tensor-parallel mesh."""
    return any(_on_tp(p) for p in layer.parameters())


def _on_tp(p: Any) -> bool:
    names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
    return "tp" in names


class TensorParallel:
    """How this process's layers are split over its stage's tensor-parallel group (see the module docstring).

    Args:
        module: the LightningModule (its ``pipeline_parallelize_layer`` hook, if any, is the plan).
        meshes: where the 1-D ``"tp"`` ``DeviceMesh`` of this process's stage is (the job's ``World``).
    """

    def __init__(self, module: nn.Module, meshes: StageWorld) -> None:
        self._hook = getattr(module, HOOK, None)
        self._meshes = meshes

    def mesh(self) -> Any:
        """The tensor-parallel mesh of this process's stage."""
        return self._meshes.tp_mesh

    def split(self, index: int, layer: nn.Module) -> None:
        """Split pipeline layer ``index`` over the mesh, unless it is split already (real or meta parameters).

        The module's hook decides where there is one; otherwise the built-in plan of the layer's type.

        Raises:
            ValueError: the layer does not divide by the mesh (heads or MLP width); the message names the setting.
        """
        if is_split(layer):
            return
        mesh = self.mesh()
        if self._hook is not None:
            self._hook(index, layer, mesh)
        else:
            plan = builtin_plan(layer, mesh.size())
            if plan:
                parallelize_module(layer, mesh, plan)


#: Bytes of gradients averaged in one collective (a larger gradient goes alone, in place): few collectives, and
#: a bounded copy.
BUCKET_BYTES = 32 * 2**20


@torch.no_grad()
def average_replicated_grads(layers: Iterable[nn.Module], tensor_parallel: TensorParallel | None) -> None:
    """Average the gradients of the parameters of ``layers`` that no plan split over the tensor-parallel group.

    A parameter split over ``"tp"`` (a DTensor on that mesh dimension) keeps its gradient: it is this process's part.
    Every other trainable parameter (a plain tensor, or under FSDP2 a DTensor on ``"dp"`` only, of which every
    tensor-parallel peer holds the same shard) gets the mean of its gradient's local part over the group, in
    buckets of up to :data:`BUCKET_BYTES` per dtype, summed and divided on the device. A peer without a gradient
    counts as a zero (as a replica without one does under data parallelism); a parameter no peer has a gradient for
    keeps none. Which peers have one rides in the last bucket; it is read on the host only where this process lacks
    a gradient another may have (a layer that may leave parameters unused): no host sync otherwise.

    Args:
        layers: this process's pipeline layers (every peer passes the same layers, in the same order).
        tensor_parallel: the stage's tensor parallelism (``None``: none, nothing to do).
    """
    if tensor_parallel is None:
        return
    group = tensor_parallel.mesh().get_group()
    params = _replicated(layers)
    if dist.get_world_size(group) == 1 or not params:
        return
    grads = [local_part(p.grad) if p.grad is not None else torch.zeros_like(local_part(p)) for p in params]
    has = torch.ones(len(params), dtype=grads[-1].dtype, device=grads[-1].device)
    missing = [i for i, p in enumerate(params) if p.grad is None]
    for i in missing:
        has[i] = 0
    _average(grads, has, group)
    if missing:
        counts = has.tolist()  # a host read, only where this process lacks a gradient
        for i in missing:
            if counts[i] > 0:
                params[i].grad = _grad_like(params[i], grads[i])


def _replicated(layers: Iterable[nn.Module]) -> list[Tensor]:
    """The trainable parameters of ``layers`` no plan split over ``"tp"`` (a tie held by two of them once)."""
    whole = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad and not _on_tp(p)}
    return list(whole.values())


def _average(grads: list[Tensor], has: Tensor, group: dist.ProcessGroup) -> None:
    """Average ``grads`` over ``group`` in place, bucket by bucket; ``has`` (summed, not divided) in the last one."""
    size = dist.get_world_size(group)
    for bucket in _buckets(grads):
        last = bucket[-1] == len(grads) - 1
        tensors = [grads[i] for i in bucket] + ([has] if last else [])
        # a lone gradient is reduced where it is; several are copied into one buffer and back
        flat = tensors[0] if len(tensors) == 1 and tensors[0].is_contiguous() else _flat(tensors)
        dist.all_reduce(flat, group=group)
        flat[: flat.numel() - (has.numel() if last else 0)].div_(size)
        if flat is not tensors[0]:
            torch._foreach_copy_(tensors, _unflat(flat, tensors))


def _buckets(grads: list[Tensor]) -> list[list[int]]:
    """Indices of ``grads`` in buckets of one dtype and device, each of up to :data:`BUCKET_BYTES`, by last index."""
    done: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    held: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, g in enumerate(grads):
        key, size = (g.dtype, g.device), g.numel() * g.element_size()
        if key in open_ and held[key] + size > BUCKET_BYTES:
            done.append(open_.pop(key))
        if key not in open_:
            open_[key], held[key] = [], 0
        open_[key].append(i)
        held[key] += size
    return sorted(done + list(open_.values()), key=lambda b: b[-1])


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    sizes = [t.numel() for t in tensors]
    return [part.view_as(t) for part, t in zip(flat.split(sizes), tensors, strict=True)]


def _grad_like(param: Tensor, local: Tensor) -> Tensor:
    """A gradient for ``param`` from its local part (a DTensor laid out as ``param`` where it is one)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


# ---------------------------------------------------------------------------------------------------------------------
def builtin_plan(layer: nn.Module, size: int) -> Plan:
    """The built-in plan of ``layer`` over ``size`` processes (``{}``: none, it runs whole).

    Raises:
        ValueError: the heads or the MLP's width of the layer do not divide by ``size``.
    """
    if isinstance(layer, Block):
        return _gpt_plan(layer, size)
    inner = getattr(layer, "layer", None)
    family = getattr(getattr(layer, "family", None), "name", None)
    if inner is not None and family == "llama":
        return _llama_plan(inner, size)
    if inner is not None and family == "gpt2":
        return _gpt2_plan(inner, size)
    return {}


def _local(style: ParallelStyle) -> ParallelStyle:
    # Every process of the stage initialised the same layer from its seed: each keeps its own part, no scatter.
    style.src_data_rank = None
    return style


def _rows() -> ParallelStyle:
    return _local(ColwiseParallel())


def _columns() -> ParallelStyle:
    return _local(RowwiseParallel())


def _divides(what: str, n: int, size: int) -> None:
    if n % size:
        raise ValueError(
            f"strategy.tensor_parallel_size={size} does not divide the layer's {n} {what}: every process of a stage "
            f"holds an equal part. Use a tensor_parallel_size that divides {n}, or a model whose {what} it divides."
        )


def _gpt_plan(block: Block, size: int) -> Plan:
    plan: Plan = {}
    if type(block.attn) is CausalSelfAttention:  # a sparse attention adapts its density over all heads at once
        _divides("attention heads (model.n_head)", block.attn.n_head, size)
        plan |= {"attn.q": _rows(), "attn.k": _rows(), "attn.v": _rows(), "attn.proj": _columns()}
    if type(block.mlp) is MLP:  # an MoE layer's experts stay whole
        _divides("MLP neurons", block.mlp.fc.out_features, size)
        plan |= {"mlp.fc": _rows(), "mlp.proj": _columns()}
    return plan


def _llama_plan(layer: nn.Module, size: int) -> Plan:
    attn, mlp = layer.self_attn, layer.mlp
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    _divides("key/value heads (num_key_value_heads)", kv_heads, size)
    _divides("attention heads (num_attention_heads)", heads, size)
    _divides("MLP neurons (intermediate_size)", mlp.gate_proj.out_features, size)
    return {
        "layer.self_attn.q_proj": _rows(),
        "layer.self_attn.k_proj": _rows(),
        "layer.self_attn.v_proj": _rows(),
        "layer.self_attn.o_proj": _columns(),
        "layer.mlp.gate_proj": _rows(),
        "layer.mlp.up_proj": _rows(),
        "layer.mlp.down_proj": _columns(),
    }


def _gpt2_plan(layer: nn.Module, size: int) -> Plan:
    _divides("MLP neurons (n_inner)", layer.mlp.c_fc.nf, size)
    return {"layer.mlp.c_fc": Conv1DRows(), "layer.mlp.c_proj": Conv1DColumns()}


class Conv1DRows(ColwiseParallel):
    """``ColwiseParallel`` for GPT-2's ``Conv1D`` (weight ``(in, out)``: the output features are its columns)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _distribute(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})
        return _with_layouts(self, module, device_mesh)


class Conv1DColumns(RowwiseParallel):
    """``RowwiseParallel`` for GPT-2's ``Conv1D`` (its input features are the weight's rows)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # the input's features split as the weight's rows
        _distribute(module, device_mesh, {"weight": Shard(0), "bias": Replicate()})
        return _with_layouts(self, module, device_mesh)


def _distribute(module: nn.Module, mesh: Any, placements: dict[str, Any]) -> None:
    for name, p in list(module.named_parameters(recurse=False)):
        split = distribute_tensor(p, mesh, [placements[name]], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))


def _with_layouts(style: Any, module: nn.Module, mesh: Any) -> nn.Module:
    """The style's input and output hooks on ``module`` (its parameters already distributed)."""
    from functools import partial

    from torch.distributed.tensor import distribute_module

    inputs = partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts)
    outputs = partial(style._prepare_output_fn, style.output_layouts, style.use_local_output)
    return distribute_module(module, mesh, None, inputs, outputs)
