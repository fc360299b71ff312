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

A layer is split once where it is built (:meth:`TensorParallel.split`), in torchtitan's order: tensor parallel,
then compile, then FSDP2. A layer that migrates travels as its local parts (each process sends its part to the
process of the same tensor-parallel rank on the receiving stage), arrives as a meta-device layer, is split again by
the same plan on the meta device and filled with the parts that came (``StageSharding.adopt``): no process ever
holds a moving layer whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from dynmo_lightning.models.blocks import MLP, Block, CausalSelfAttention

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
        mesh: returns the 1-D ``"tp"`` ``DeviceMesh`` of this process's stage.
    """

    def __init__(self, module: nn.Module, mesh: Callable[[], Any]) -> None:
        self._hook = getattr(module, HOOK, None)
        self._mesh = mesh

    def mesh(self) -> Any:
        """The tensor-parallel mesh of this process's stage."""
        return self._mesh()

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
