"""Data parallelism inside each stage: DDP, or torch's FSDP2 / replicate over the stage's replica group.

``DynMoStrategy(data_parallel=...)`` chooses how the ``D`` replicas of a stage (the processes that hold the same
pipeline rank in every replica, a ``DeviceMesh`` of one dimension) share its layers:

- ``"ddp"``: every replica holds the whole stage, the stage module is wrapped in ``DistributedDataParallel`` for
  the step (gradients all-reduced bucket by bucket during the last micro-batch's backward).
- ``"fsdp"``: FSDP2 (``fully_shard``) on every pipeline layer and on the stage module, as torchtitan does: every
  replica holds ``1/D`` of each layer's weights, gradients and optimizer state (DTensors sharded on dim 0);
  parameters are all-gathered before a layer runs and kept for the rest of the step (``reshard_after_forward=False``
  under a pipeline, so no all-gather per micro-batch), gradients reduce-scattered after the last backward.
- ``"replicate"``: torch's FSDP-based ``replicate`` on the same units: whole weights, gradients all-reduced after
  the last backward, through the same hooks as FSDP2 (which torch's split backward drives: the zero-bubble
  schedules run with replicas under ``replicate`` and ``fsdp``).

Under ``fsdp``/``replicate`` a layer is a unit of its own for its whole life here: sharded once where it is built,
sent shard by shard when it migrates (:class:`ShardedPickling`: each source rank sends its local shards to the
rank of the same replica index on the destination pipeline rank, which builds the layer on the meta device and
shards it again over its own replica group, so no process ever holds a moving layer whole) and re-registered on
arrival. Stage modules are rebuilt with every schedule; each becomes the FSDP root of its layers
(:meth:`StageSharding.wrap`), which is what torch's pipeline stage drives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dynmo_lightning.core.model import may_leave_parameters_unused
from dynmo_lightning.core.parts import fsdp_param_groups
from dynmo_lightning.core.parts import local_part as local
from dynmo_lightning.pipeline.parallel.tensor_parallel import TensorParallel
from dynmo_lightning.pipeline.topology.world import StageWorld

#: What ``DynMoStrategy(data_parallel=...)`` accepts.
MODES = ("ddp", "replicate", "fsdp")

#: Modes whose units are torch's FSDP2 machinery (DTensor parameters, driven by the pipeline stage itself).
FSDP_MODES = ("replicate", "fsdp")


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 or replicate unit (its parameters are DTensors it manages)."""
    return isinstance(module, FSDPModule)


def _state(module: nn.Module) -> Any:
    return replicate.state(module) if isinstance(module, ReplicateModule) else fully_shard.state(module)


@dataclasses.dataclass(eq=False)  # one object per process, compared by identity as before
class StageSharding:
    """How this process's stages share their layers with their replicas (see the module docstring).

    Args:
        mode: a key of :data:`MODES`.
        meshes: where this process's replica mesh is (the job's ``World``, read again after the world changes:
            :meth:`mesh`; ``FixedWorld()`` for one replica under ``"ddp"``).
        device: where this process's layers live.
        param_dtype: the dtype layers compute in under ``bf16-mixed`` (FSDP2's ``MixedPrecisionPolicy``: the
            sharded parameters and the gradient reduction stay in float32); ``None``: the parameters' own.
        tensor_parallel: how layers are split over the stage's tensor-parallel group (``None``: they are not), before
            they become units: FSDP2 then shards every process's part over the replicas (2-D parameters).
        lean: ``fsdp_memory="lean"``: units free their gathered weights after every forward and backward, and the
            pipeline stage reduce-scatters gradients after every micro-batch's backward (``"fsdp"`` only).
    """

    mode: str
    meshes: StageWorld
    device: torch.device
    param_dtype: torch.dtype | None = None
    tensor_parallel: TensorParallel | None = None
    lean: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"strategy.data_parallel={self.mode!r} is not one of {list(MODES)}")

    @classmethod
    def of(
        cls,
        mode: str,
        meshes: StageWorld,
        device: torch.device,
        precision: Any,
        tensor_parallel: TensorParallel | None = None,
        fsdp_memory: str = "fast",
    ) -> StageSharding:
        """The sharding of ``mode`` under Lightning's ``precision`` plugin: FSDP2 computes in bf16 under bf16-mixed.

        ``fsdp_memory``: ``DynMoStrategy(fsdp_memory=...)`` (``"lean"``: see :attr:`lean`).
        """
        bf16 = isinstance(precision, MixedPrecision) and precision.precision == "bf16-mixed"
        param_dtype = torch.bfloat16 if bf16 and mode in FSDP_MODES else None
        return cls(mode, meshes, device, param_dtype, tensor_parallel, lean=mode == "fsdp" and fsdp_memory == "lean")

    def set_lean(self, lean: bool, layers: Iterable[nn.Module]) -> None:
        """Run ``fsdp_memory="lean"`` (or ``"fast"``) from the next step on, with this process's ``layers``.

        Stage roots are made again with the next schedule (the runtime's ``invalidate``), and every unit gathers and
        frees its weights per forward from now on (or keeps them for the step).
        """
        self.lean = lean and self.mode == "fsdp"
        for layer in layers:
            for unit in layer.modules():
                if is_unit(unit):
                    unit.set_reshard_after_forward(self.lean, recurse=False)

    @property
    def units(self) -> bool:
        """Whether layers are FSDP2 / replicate units (``"fsdp"``, ``"replicate"``)."""
        return self.mode in FSDP_MODES

    @property
    def sharded(self) -> bool:
        """Whether a layer's parameters are split over the replicas (``"fsdp"``)."""
        return self.mode == "fsdp"

    def mesh(self) -> Any:
        """This process's replica mesh (1-D)."""
        return self.meshes.replica_mesh

    def mesh_of(self, dims: tuple[str, ...]) -> Any:
        """This process's mesh of the dimensions ``dims`` a DTensor that arrived was laid out on.

        ``("dp",)``: the replicas (FSDP2, replicate); ``("tp",)``: the tensor-parallel group; ``("dp", "tp")``: both
        (FSDP2 over tensor-parallel parts), the mesh FSDP2 itself makes of the two.
        """
        if dims == ("dp",):
            return self.mesh()
        assert self.tensor_parallel is not None, f"a DTensor on {dims} arrived at a process without tensor parallelism"
        tp = self.tensor_parallel.mesh()
        return tp if dims == ("tp",) else DeviceMesh._concatenate([self.mesh(), tp])

    def split(self, index: int, layer: nn.Module) -> None:
        """Split layer ``index`` over the stage's tensor-parallel group (first of all: before compile and FSDP2)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.split(index, layer)

    def _apply(self, module: nn.Module | list[nn.Module]) -> None:
        mp = MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=torch.float32 if self.param_dtype else None
        )
        if self.mode == "fsdp":
            fully_shard(module, mesh=self.mesh(), reshard_after_forward=self.lean, mp_policy=mp)
        else:
            replicate(module, mesh=self.mesh(), mp_policy=mp)

    # --- layers -------------------------------------------------------------------------------------------------
    def shard_layers(self, layers: Iterable[nn.Module]) -> None:
        """Make every one of this process's ``layers`` (real, on its device) a unit, unless it is one already.

        Raises:
            ValueError: two of them share a parameter (a tie kept as one tensor on this process): FSDP manages a
                parameter in one unit only.
        """
        if not self.units:
            return
        layers = list(layers)
        todo = [layer for layer in layers if not is_unit(layer)]
        seen: dict[int, int] = {}
        for n, layer in enumerate(layers):
            for p in layer.parameters():
                if seen.setdefault(id(p), n) != n:
                    raise ValueError(
                        f"strategy.data_parallel={self.mode!r} makes every pipeline layer its own unit, and two "
                        "layers on this process share a parameter (a tie, e.g. a token embedding tied to the head "
                        "under a V schedule, which puts the first and last stage on one process): untie it "
                        "(dynmo-train: model.tie_embeddings=false), or use strategy.data_parallel='ddp'"
                    )
        for layer in todo:
            self._apply(layer)

    def make_unit(self, layer: nn.Module) -> None:
        """Make ``layer`` (real or on the meta device) a unit, unless it is one or layers are not units (DDP)."""
        if self.units and not is_unit(layer):
            self._apply(layer)

    def wrap(self, module: nn.Module, replicas: dist.ProcessGroup | None) -> nn.Module:
        """The stage module for a step: in DDP over ``replicas``, or the FSDP root of its (unit) layers.

        A new root is made whenever the stages are rebuilt: the layers' units forget the root they had, so the new
        one takes them over at its first forward (torch's pipeline stage drives the root: gradient sync off for
        every micro-batch, the reduction after the last).
        """
        if self.units:
            self.forget_root(module.modules())
            self._apply(module)
            return module
        if replicas is None or not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to average (one replica, or a stage whose layers are all frozen)
        return DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=replicas,
            broadcast_buffers=False,
            find_unused_parameters=may_leave_parameters_unused(module),
            init_sync=False,
            gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy of every gradient
        )

    def step_bytes(self, layer: nn.Module) -> dict[str, int]:
        """What a training step holds of ``layer`` beyond its weights and optimizer state, as FSDP2 runs it.

        ``grad_bytes``: its gradients from the stage's first backward to the end of the step; ``gathered_bytes``:
        what it holds only while it runs; ``weight_copies_bytes``: gathered weights held for the step. Not units
        (DDP, tensor parallelism alone): this process's gradients, nothing gathered (the weight copies are the
        profiler's: autocast's). FSDP2 / replicate units under a pipeline, gradient sync off until the last
        micro-batch (``fsdp_memory="fast"``, and units that may leave a parameter unused): the gathered layer's whole
        gradients in the reduction dtype (float32 under bf16-mixed) from the first backward on, and its gathered
        weights for the whole step. ``"lean"``: the gradient's shard (accumulated reductions), and while the layer
        runs its gathered weights, its whole gradient and the reduce-scatter's buffers. A unit that can run either
        way also gets both ways' numbers (``fast_*``, ``lean_*``): the balancer chooses under
        ``fsdp_memory="auto"``.
        """
        trained = [p for p in layer.parameters() if p.requires_grad]
        if not self.units or not is_unit(layer):
            return {"grad_bytes": sum(local(p).numel() * p.element_size() for p in trained), "gathered_bytes": 0}
        params = list(layer.parameters())
        reduce = _itemsize(torch.float32 if self.param_dtype else params[0].dtype) if params else 0
        compute = _itemsize(self.param_dtype) if self.param_dtype else reduce
        whole = sum(_gathered_numel(p) for p in trained)
        shards = sum(local(p).numel() for p in trained)
        weights = sum(_gathered_numel(p) for p in params) * compute
        fast = {"grad_bytes": whole * reduce, "gathered_bytes": 0, "weight_copies_bytes": weights}
        lean = {"grad_bytes": shards * reduce, "gathered_bytes": weights + whole * (compute + reduce) + shards * reduce,
                "weight_copies_bytes": 0}  # fmt: skip
        if self.mode != "fsdp" or may_leave_parameters_unused(layer):  # reduced once per step, whatever the setting
            return fast
        both = {"fast_grad_bytes": fast["grad_bytes"], "fast_copies_bytes": weights,
                "lean_grad_bytes": lean["grad_bytes"], "lean_gathered_bytes": lean["gathered_bytes"]}  # fmt: skip
        return {**(lean if self.lean else fast), **both}

    @staticmethod
    def forget_root(modules: Iterable[nn.Module]) -> None:
        """Detach the units among ``modules`` from the root of the stage they last ran in (its stage is rebuilt).

        A root's first forward gives every unit under it one shared context listing all of them: a unit that stays
        on this process would otherwise keep the ones that left, weights and all, until the next step's root takes
        over. torch has no public reset: the next root finds its units again at its first forward. Each parameter
        group's positions in the old root's forward order go too: the next root's order starts empty, and a
        position a backward had not consumed (a unit whose backward did not run in the last step, a split
        backward) would make FSDP2's backward prefetch index past its end.
        """
        for unit in modules:
            if is_unit(unit):
                state = _state(unit)
                state._is_root = None
                state._state_ctx = type(state._state_ctx)()  # FSDP2's context, or replicate's
                for group in fsdp_param_groups(state):
                    group._post_forward_indices.clear()

    @staticmethod
    def reshard(modules: Iterable[nn.Module]) -> None:
        """Free the all-gathered parameters of the units in ``modules`` (after a forward-only schedule)."""
        for module in modules:
            for unit in module.modules():
                if is_unit(unit):
                    unit.reshard()

    def fill_unused_grads(self, module: nn.Module, host_group: dist.ProcessGroup | None) -> None:
        """Before the reduction: a zero gradient where another replica has one, every unit's gradients in one dtype.

        FSDP2 reduce-scatters the gradients present, in order: replicas that miss different ones (an expert no token
        of this replica reached) would reduce tensors of different sizes. Which parameters have a gradient is host
        data, OR-ed over ``host_group`` (the replicas' CPU group), only for units that say a step may leave
        parameters unused (``pipeline_unused_parameters``); one no replica used keeps no gradient, as in one process.

        FSDP2 also reduces a unit's gradients as one buffer of one dtype ("expects uniform gradient dtype"): it
        takes ``unsharded_accumulated_grad`` where there is one (the reduction dtype, float32 under bf16-mixed: with
        gradient sync off until the last micro-batch, each post-backward moves ``.grad`` there), else ``.grad`` (the
        compute dtype). A zero goes where the unit's other gradients are, and a ``.grad`` that came after the last
        post-backward (a split backward's last weight pass) joins the accumulated ones (:func:`_one_grad_dtype`).
        """
        groups = [
            (group, may_leave_parameters_unused(unit))
            for unit in module.modules()
            if is_unit(unit) and unit is not module
            for group in fsdp_param_groups(_state(unit))
        ]
        unused = [fp for group, unused in groups if unused for fp in group.fsdp_params if _trains(fp)]
        fill = _used_elsewhere(unused, host_group) if self.mesh().size() > 1 else set()
        for group, _ in groups:
            _one_grad_dtype(group.fsdp_params, fill)

    # --- migration ----------------------------------------------------------------------------------------------
    def adopt(self, index: int, module: nn.Module, shards: dict[int, Tensor]) -> nn.Module:
        """Make layer ``index``, arrived as :class:`ShardedPickling` left it, split and a unit again, with its shards.

        Its parameters arrived as meta tensors of their full shape (``shards``: the received shard of each, by the
        placeholder's ``id``). The layer is split over this process's tensor-parallel group and sharded over its
        replica group on the meta device (nothing whole is allocated), and every received shard *becomes* its
        parameter's local part (``DTensor.from_local``, assigned): the memory it was received into is the
        parameter's, so an arriving layer costs no more than its parts. FSDP2 takes a parameter over from its
        assigned part (``reset_sharded_param``, which copies only a part it must pad: a dimension ``D`` does not
        divide). Buffers, and parameters a tensor-parallel plan leaves whole, arrived whole with their values.
        """
        by_name = {name: shards.pop(id(p)) for name, p in module.named_parameters() if id(p) in shards}
        if not by_name:
            return module
        # parameters a tensor-parallel plan leaves whole (norms) arrived whole, with their values
        whole = {name: p for name, p in module.named_parameters() if name not in by_name}
        self.split(index, module)
        self.make_unit(module)
        state: dict[str, Tensor] = {}
        for name, p in module.named_parameters():
            part = by_name.pop(name, None)
            if part is None:
                state[name] = whole.pop(name)
            else:
                state[name] = DTensor.from_local(part, p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())  # fmt: skip
        # assign: no copy; strict=False: the buffers stay the received ones (not in ``state``)
        module.load_state_dict(state, strict=False, assign=True)
        return module


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gathered_numel(p: Tensor) -> int:
    """Elements of ``p`` once FSDP2 gathered it over the replicas (``"dp"``): the process's tensor-parallel part."""
    part = local(p).numel()
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ("dp",) * p.device_mesh.ndim
        for dim, placement in enumerate(p.placements):
            if names[dim] == "dp" and not placement.is_replicate():
                part *= p.device_mesh.size(dim)
    return part


def _has_grad(fp: Any) -> bool:
    return fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None


def _used_elsewhere(params: list[Any], host_group: dist.ProcessGroup | None) -> set[int]:
    """Ids of the FSDP2 parameters among ``params`` without a gradient here that another replica has one for."""
    if not params:
        return set()
    has = torch.tensor([_has_grad(fp) for fp in params], dtype=torch.uint8)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=host_group)
    return {id(fp) for fp, used in zip(params, has.tolist(), strict=True) if used and not _has_grad(fp)}


def _trains(fp: Any) -> bool:
    # FSDP2 collects only parameters it has unsharded this step (`post_backward` skips the others)
    return fp.sharded_param.requires_grad and hasattr(fp, "_unsharded_param")


def _one_grad_dtype(fsdp_params: Sequence[Any], fill: set[int]) -> None:
    """A zero gradient for the parameters of one FSDP2 group in ``fill`` (ids); all it will collect in one dtype.

    Where some parameter of the group accumulated (``unsharded_accumulated_grad``, the reduction dtype), the zeros
    are accumulated gradients of that dtype and a lone ``.grad`` is moved there by FSDP2's own cast
    (``to_accumulated_grad_if_needed``); otherwise every gradient is a ``.grad`` of the compute dtype. Host checks
    and device casts only: no host sync.
    """
    accumulates = any(fp.unsharded_accumulated_grad is not None for fp in fsdp_params if _trains(fp))
    for fp in fsdp_params:
        if id(fp) in fill:
            param = fp.unsharded_param
            if accumulates:
                fp.unsharded_accumulated_grad = torch.zeros_like(param, dtype=fp.reduce_dtype)
            else:
                param.grad = torch.zeros_like(param)
        elif accumulates and _trains(fp) and fp.unsharded_accumulated_grad is None:
            fp.to_accumulated_grad_if_needed()  # a lone `.grad` (none: nothing to do) in the reduction dtype
