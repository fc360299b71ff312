"""What the launching process refuses before any worker starts, each naming the setting and the fix.

Lightning's launcher starts the worker processes before the strategy sees the model, so a mistake found in set-up
(more stages than layers, a batch that does not split into micro-batches) would be reported by every worker, after
all of them started. :func:`check_job` receives the arguments of ``trainer.fit`` (and ``validate``,
``test``, ``predict``) and checks them first, in the launching process: one message, before any worker starts.
Under torchrun or SLURM, where every process is started from outside, each process runs the same checks before it
joins the job. The checks here are also what the strategy runs in set-up, so both paths say the same thing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils.data import DataLoader

from dynmo_lightning.balance.split.placement import V_SCHEDULES
from dynmo_lightning.core.composition import Composition, refuse
from dynmo_lightning.core.control import JobShape, PreLaunchCheck
from dynmo_lightning.core.model import PipelineModule, ProtocolError, check_protocol
from dynmo_lightning.pipeline.parallel.data_parallel import FSDP_MODES
from dynmo_lightning.pipeline.parallel.data_parallel import MODES as DATA_PARALLEL
from dynmo_lightning.pipeline.parallel.tensor_parallel import HOOK as TP_HOOK
from dynmo_lightning.pipeline.parallel.tensor_parallel import builtin_plan
from dynmo_lightning.pipeline.stage.cut import PARTITIONS, initial_partition
from dynmo_lightning.pipeline.stage.evaluation import EVAL_HOOK
from dynmo_lightning.pipeline.stage.schedules import SCHEDULES, SPLIT_BACKWARD
from dynmo_lightning.pipeline.topology.ranks import check_batch
from dynmo_lightning.recompute import checkpoint_policy


def check_arguments(
    n_microbatches: Any,
    schedule: Any,
    partition: Any,
    stages_per_rank: Any,
    data_parallel_size: Any,
    heartbeat_timeout: float,
    activation_checkpointing: Any = None,
    data_parallel: Any = "ddp",
    tensor_parallel_size: Any = 1,
) -> None:
    """Refuse bad ``DynMoStrategy`` arguments with a message naming the setting.

    Raises:
        ValueError: a setting is out of range or unknown.
    """
    # One check per setting, in the order users have always been told of the first wrong one.
    _check_positive_int("n_microbatches", n_microbatches)
    _check_schedule(schedule)
    _check_partition(partition)
    _check_positive_int("stages_per_rank", stages_per_rank)
    _check_positive_int("data_parallel_size", data_parallel_size)
    _check_heartbeat_timeout(heartbeat_timeout)
    _check_data_parallel(data_parallel)
    _check_positive_int("tensor_parallel_size", tensor_parallel_size)
    checkpoint_policy(activation_checkpointing)
    # what cannot compose (tensor parallelism or a split backward under DDP replicas): the one table
    refuse(Composition(data_parallel, data_parallel_size, tensor_parallel_size, schedule, schedule in SPLIT_BACKWARD))


def _check_positive_int(name: str, value: Any) -> None:
    """Refuse a ``DynMoStrategy`` setting that must be a positive integer and is not.

    Args:
        name: the setting's name (as in ``strategy.<name>``).
        value: its value.

    Raises:
        ValueError: ``value`` is not an ``int`` of at least 1.
    """
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"strategy.{name}={value!r} must be a positive integer")


def _check_schedule(schedule: Any) -> None:
    """Refuse an unknown ``strategy.schedule``.

    Raises:
        ValueError: ``schedule`` is not one of :data:`SCHEDULES`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"strategy.schedule={schedule!r} is not one of {sorted(SCHEDULES)}")


def _check_partition(partition: Any) -> None:
    """Refuse an unknown named ``strategy.partition`` (a list of layers per stage is checked in set-up).

    Raises:
        ValueError: ``partition`` is a string other than one of :data:`PARTITIONS`.
    """
    if isinstance(partition, str) and partition not in PARTITIONS:
        raise ValueError(
            f"strategy.partition={partition!r} is not one of {list(PARTITIONS)} or a list of layers per stage"
        )


def _check_heartbeat_timeout(heartbeat_timeout: float) -> None:
    """Refuse a ``strategy.heartbeat_timeout`` that is not a positive number of seconds.

    Raises:
        ValueError: ``heartbeat_timeout`` is zero or negative.
    """
    if heartbeat_timeout <= 0:
        raise ValueError(f"strategy.heartbeat_timeout={heartbeat_timeout} must be > 0 seconds")


def _check_data_parallel(data_parallel: Any) -> None:
    """Refuse an unknown ``strategy.data_parallel`` mode.

    Raises:
        ValueError: ``data_parallel`` is not one of the sharding modes.
    """
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"strategy.data_parallel={data_parallel!r} is not one of {list(DATA_PARALLEL)} (ddp: whole stages "
            "per replica; fsdp: FSDP2 shards every layer over the replicas; replicate: torch's FSDP-based replicate)"
        )


#: ``DynMoStrategy(fsdp_memory=...)``: gather and reduce once per step, per micro-batch, or as the balancer finds.
FSDP_MEMORY = ("fast", "lean", "auto")


def check_fsdp_memory(fsdp_memory: Any, data_parallel: str, schedule: str) -> None:
    """Refuse an unknown ``strategy.fsdp_memory``, and ``"lean"`` where it cannot apply.

    Raises:
        ValueError: not one of :data:`FSDP_MEMORY`; ``"lean"`` without FSDP2 or with a split backward.
    """
    if fsdp_memory not in FSDP_MEMORY:
        raise ValueError(f"strategy.fsdp_memory={fsdp_memory!r} is not one of {list(FSDP_MEMORY)}")
    split = schedule in SPLIT_BACKWARD
    refuse(Composition(data_parallel, schedule=schedule, split_backward=split, fsdp_memory=fsdp_memory))


def check_world(world_size: int, data_parallel_size: int, tensor_parallel_size: int = 1) -> None:
    """Refuse a job whose processes do not divide into equal pipeline replicas of equally split stages."""
    if world_size % (data_parallel_size * tensor_parallel_size):
        split = f" x tensor_parallel_size={tensor_parallel_size}" if tensor_parallel_size > 1 else ""
        raise ValueError(
            f"strategy.data_parallel_size={data_parallel_size}{split} does not divide the job's {world_size} "
            "processes (Trainer devices x num_nodes): every replica needs the same number of pipeline stages, each "
            f"split over the same number of processes. Use sizes whose product divides {world_size}, or change the "
            "number of processes."
        )


def check_trainer(trainer: pl.Trainer, module: pl.LightningModule, precision: Precision) -> None:
    """Refuse Trainer settings the pipeline cannot honour (each message says what to use instead)."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported by "
            "DynMoStrategy: the pipeline already accumulates gradients over micro-batches. Use a larger batch "
            "with strategy n_microbatches instead (e.g. multiply both by the accumulation factor)."
        )
    if not module.automatic_optimization:
        raise ValueError(
            "DynMoStrategy needs automatic optimization (the pipeline schedule runs backward itself); remove "
            "`self.automatic_optimization = False` from the module."
        )
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise ValueError(
            "Trainer(precision='16-mixed') is not supported by DynMoStrategy: fp16 needs gradient scaling inside the "
            "pipeline schedule, which it does not do. bf16-mixed is the supported mixed precision: use "
            "precision='bf16-mixed' (dynmo-train: trainer.precision=bf16-mixed, the default on GPUs), or '32-true'."
        )


def check_v_schedule(schedule: str, backend: str | None, devices: Sequence[torch.device]) -> None:
    """Refuse a V schedule on gloo with a torch whose pipeline runtime sends a stage's outputs to the same process.

    ZBV and DualPipeV put stages ``P - 1`` and ``P`` on one rank; torch 2.11's schedule runtime exchanges their
    shapes with a point-to-point send to that same process at its first step, which gloo cannot do ("Pair is not
    connected"). torch 2.13 keeps it local (tested); NCCL sends to itself.

    Raises:
        ValueError: a V schedule on CPU devices (or gloo) with torch older than 2.13.
    """
    on_gloo = backend == "gloo" or (backend is None and not any(d.type == "cuda" for d in devices))
    if schedule in V_SCHEDULES and on_gloo and torch.__version__ < (2, 13):
        raise ValueError(
            f"strategy.schedule={schedule!r} on gloo needs torch >= 2.13 (this is {torch.__version__}): torch's "
            "pipeline runtime sends the V's two middle stages' shapes from a process to itself, which gloo cannot "
            "do. Use strategy.schedule='interleaved_zb' (the looped zero-bubble schedule), NCCL on GPUs, or a newer "
            "torch."
        )


def check_backend(backend: str | None, devices: Sequence[torch.device]) -> None:
    """Refuse a process group backend that cannot carry the devices' tensors: gloo for CUDA devices.

    Stages send activations and gradients from their device; gloo sends CPU tensors only, so a GPU pipeline over
    gloo would fail at its first transfer, after every worker started.

    Args:
        backend: ``DynMoStrategy(process_group_backend=...)`` (``None``: chosen per device, NCCL for GPUs).
        devices: the job's devices on this node.

    Raises:
        ValueError: the backend cannot send the devices' tensors; the message names the setting and the fix.
    """
    if backend is None or not any(d.type == "cuda" for d in devices):
        return
    for_cuda = dict(part.split(":", 1) for part in backend.split(",")).get("cuda") if ":" in backend else backend
    if for_cuda == "gloo":
        raise ValueError(
            f"strategy.process_group_backend={backend!r} cannot run a pipeline on CUDA devices: gloo sends CPU "
            "tensors only, and the stages send activations and gradients from their GPU. Leave "
            "process_group_backend unset (NCCL is chosen for GPUs) or set it to 'nccl'; to use gloo, train on CPU "
            "(trainer.accelerator=cpu)."
        )


def check_model(module: Any) -> None:
    """Refuse a module the pipeline cannot train as it is.

    Not pipeline-ready, no ``training_step`` (Lightning would refuse it), or evaluation steps of its own that the
    pipeline would skip without a word.
    """
    if not (callable(getattr(module, "pipeline_layers", None)) and callable(getattr(module, "pipeline_loss", None))):
        check_protocol(module)  # raises the explanatory ProtocolError
    if not is_overridden("training_step", module):
        raise ProtocolError(
            f"{type(module).__name__} has no training_step; Lightning requires one even though DynMoStrategy runs "
            "the pipeline itself. Subclass dynmo_lightning.PipelineModule (it provides the steps from "
            "pipeline_layers/pipeline_loss, also for single-process runs) instead of LightningModule."
        )
    base = PipelineModule if isinstance(module, PipelineModule) else pl.LightningModule
    for step, stage in (("validation_step", "val"), ("test_step", "test")):
        if is_overridden(step, module, parent=base) and not callable(getattr(module, EVAL_HOOK, None)):
            raise ProtocolError(
                f"{type(module).__name__} defines {step}, which DynMoStrategy never calls: it runs the pipeline "
                f"and logs {stage}_loss itself ({stage}_ppl too for token targets). "
                f"Compute the rest from the last layer's output in {EVAL_HOOK}(output, target, stage), which the "
                "strategy calls on the last stage and logs on every process (docs/usage.md, 'Evaluation metrics'); "
                f"call it from {step} for plain Lightning runs. If {step} logs only the loss, define an empty "
                f"{EVAL_HOOK}."
            )


def meta_layers(module: pl.LightningModule) -> list[nn.Module] | None:
    """The pipeline layers of ``module``, without building its weights (``None``: cannot tell).

    A module that creates its layers in ``configure_model`` has no parameters yet: a copy builds them on the meta
    device (the module itself stays untouched, so callbacks can still configure it before its layers exist).
    """
    try:
        if next(module.parameters(), None) is not None:
            return check_protocol(module)
        shell = copy.deepcopy(module)
        with torch.device("meta"):
            shell.configure_model()
            return check_protocol(shell)
    except Exception:
        return None  # the strategy checks the real module in set-up, on every process


def layer_param_bytes(layers: Sequence[nn.Module] | None) -> list[int] | None:
    """Parameter bytes of every one of ``layers`` (``None``: unknown)."""
    if layers is None:
        return None
    return [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]


def check_units(layers: Sequence[nn.Module], data_parallel: str, schedule: str) -> None:
    """Refuse layers FSDP2 / replicate cannot make units of: scalar parameters, a tie kept on one process.

    Raises:
        ValueError: the message names the layer, the parameter and what to do.
    """
    if data_parallel not in FSDP_MODES:
        return
    for i, layer in enumerate(layers):
        scalar = next((name for name, p in layer.named_parameters() if p.dim() == 0), None)
        if scalar is not None:
            raise ValueError(
                f"strategy.data_parallel={data_parallel!r} cannot wrap pipeline layer {i} "
                f"({type(layer).__name__}): its parameter {scalar!r} is a scalar, which FSDP2 cannot shard. Make it "
                "a 1-D tensor of one element, or use strategy.data_parallel='ddp'"
            )
    if schedule in V_SCHEDULES and tied_ends(layers):
        raise ValueError(
            f"strategy.data_parallel={data_parallel!r} with strategy.schedule={schedule!r}: the V puts the first "
            "and the last stage on one process, and their layers share a parameter (tied embeddings), which "
            "FSDP2 cannot manage in two units. Untie it (dynmo-train: model.tie_embeddings=false), use "
            "strategy.data_parallel='ddp' with one replica, or a looped schedule ('interleaved_zb')"
        )


def tied_ends(layers: Sequence[nn.Module]) -> bool:
    """Whether the first and the last of ``layers`` share a parameter (tied embeddings)."""
    return bool(layers) and bool({id(p) for p in layers[0].parameters()} & {id(p) for p in layers[-1].parameters()})


def check_tensor_parallel(module: Any, layers: Sequence[nn.Module], size: int) -> None:
    """Refuse layers the built-in tensor-parallel plans cannot split evenly over ``size`` processes, or cannot split.

    A module with its own ``pipeline_parallelize_layer`` answers for its plan itself.

    Raises:
        ValueError: heads or an MLP's width that ``size`` does not divide, or no layer a built-in plan splits (every
            process of a stage would compute the same); the message names the setting and the fix.
    """
    if size == 1 or callable(getattr(module, TP_HOOK, None)):
        return
    if not [plan for layer in layers if (plan := builtin_plan(layer, size))]:
        raise ValueError(
            f"strategy.tensor_parallel_size={size} splits nothing: no layer of {type(module).__name__} has a built-in "
            f"plan (the reference GPT's blocks, Hugging Face Llama / Mistral / Qwen2 / GPT-2 layers), and it has no "
            f"{TP_HOOK}(index, layer, tp_mesh) to split its own (docs/usage.md). Write one, or use "
            "strategy.tensor_parallel_size=1"
        )


def batch_sizes(args: Iterable[Any]) -> list[int]:
    """Batch sizes of the dataloaders (and a datamodule's ``batch_size``) among a Trainer call's arguments."""
    sizes = []
    for arg in args:
        loaders = arg if isinstance(arg, (list, tuple)) else [arg]
        sizes += [dl.batch_size for dl in loaders if isinstance(dl, DataLoader) and isinstance(dl.batch_size, int)]
        if isinstance(arg, pl.LightningDataModule):
            size = getattr(arg, "batch_size", None) or arg.hparams.get("batch_size")
            if isinstance(size, int):
                sizes.append(size)
    return sizes


def check_batch_sizes(args: Iterable[Any], n_microbatches: int, n_parts: int = 1) -> None:
    """Refuse dataloaders whose batches cannot split into ``n_parts`` parts of ``n_microbatches`` micro-batches."""
    for size in batch_sizes(args):
        check_batch(size, n_microbatches, n_parts)


def check_job(strategy: Any, trainer: pl.Trainer, *call_args: Any) -> None:
    """What the launching process can check of a job, before any worker starts.

    Trainer settings, backend, replicas, stages, batch sizes, and every callback's settings against the job's size
    (:class:`~dynmo_lightning.protocol.PreLaunchCheck`).

    Args:
        strategy: the ``DynMoStrategy`` (its settings are read here).
        trainer: the Trainer.
        *call_args: the arguments of the Trainer call (``fit``: model, loaders, datamodule, ...).

    Raises:
        ValueError: the job cannot run; the message names the setting and how to fix it.
    """
    module = call_args[0] if call_args else None
    world_size = strategy.num_nodes * strategy.num_processes
    tp = strategy.settings.tensor_parallel_size
    check_world(world_size, strategy.data_parallel_size, tp)
    check_backend(strategy.process_group_backend, strategy.parallel_devices or [])
    check_v_schedule(strategy.schedule, strategy.process_group_backend, strategy.parallel_devices or [])
    pp_size, sizes, layers = world_size // (strategy.data_parallel_size * tp), None, None
    data_parallel = strategy.settings.data_parallel
    if isinstance(module, pl.LightningModule):
        check_model(module)
        check_trainer(trainer, module, strategy.precision_plugin.inner)
        layers = meta_layers(module)
        sizes = layer_param_bytes(layers)
        if layers is not None:
            check_units(layers, data_parallel, strategy.schedule)
            check_tensor_parallel(module, layers, tp)
        if sizes is not None:
            initial_partition(
                strategy.partition,
                [1] * len(sizes),
                pp_size=pp_size,
                stages_per_rank=strategy.stages_per_rank,
                schedule=strategy.schedule,
                n_microbatches=strategy.n_microbatches,
            )
    check_batch_sizes(call_args[1:], strategy.n_microbatches)
    job = JobShape(world_size, pp_size, strategy.stages_per_rank, sizes, data_parallel, tp, tied_ends(layers or []))
    for callback in trainer.callbacks:
        if isinstance(callback, PreLaunchCheck):
            callback.pipeline_check_job(job)
