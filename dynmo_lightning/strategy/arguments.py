"""The strategy's settings, once: :class:`StrategySettings` (the Python API and the Hydra group ``strategy``).

:class:`StrategyArguments` adds the Lightning plugins the Trainer sets: together they are ``DynMoStrategy``'s
keyword arguments (its signature, for type checkers and LightningCLI).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision

from dynmo_lightning.pipeline.checkpoint import sharded
from dynmo_lightning.pipeline.elastic.lost import check_on_peer_lost
from dynmo_lightning.pipeline.parallel.compiled import check_options
from dynmo_lightning.recompute import Policy
from dynmo_lightning.strategy import checks


@dataclasses.dataclass(kw_only=True)
class StrategySettings:
    """:class:`~dynmo_lightning.DynMoStrategy`'s settings (Hydra: the keys of ``conf/strategy/dynmo.yaml``).

    Raises:
        ValueError: a setting is out of range or unknown (the message names it as ``strategy.<name>``).
    """

    n_microbatches: int = 4
    """Micro-batches per batch; the batch size must be a multiple of it."""
    schedule: str = "1f1b"
    """``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or a zero-bubble schedule (backward split into its input and
    weight parts; replicas under ``data_parallel="fsdp"`` or ``"replicate"``, no activation checkpointing):
    ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"``."""
    partition: str | list[int] = "uniform"
    """Initial layers per stage: ``"uniform"`` (by layer count), ``"params"`` (balance parameter counts, as
    DeepSpeed does), or an explicit list such as ``[3, 5]``."""
    stages_per_rank: int = 1
    """Stages per process: 1 for GPipe and 1F1B, >= 2 for the interleaved schedules, 2 for ``"zbv"`` and
    ``"dualpipev"`` (stages s and 2P - 1 - s on rank s)."""
    data_parallel_size: int = 1
    """Replicas of the pipeline (DP x PP); the number of processes must be a multiple of it. The dataloader's batch
    size is per replica, as with DDP."""
    data_parallel: str = "ddp"
    """How the replicas share each stage's layers: ``"ddp"`` (every replica holds them whole, DDP averages the
    gradients), ``"fsdp"`` (FSDP2 shards every layer's weights, gradients and optimizer state over the replicas:
    ``1/D`` per process) or ``"replicate"`` (torch's FSDP-based replicate: whole layers, FSDP2's hooks). The two
    last also run the zero-bubble schedules with replicas (docs/scale_out.md)."""
    fsdp_memory: str = "fast"
    """How FSDP2 (``data_parallel="fsdp"``) holds a stage's layers during a step. ``"fast"``: each layer's weights
    are gathered once per step and its gradients reduce-scattered once, after the last micro-batch, so the whole
    stage's gathered weights and its whole gradients (in the reduction dtype, float32 under bf16-mixed) are held from
    the first forward to the end of the step; only optimizer state and the fp32 weights are ``1/D`` (the least
    communication). ``"lean"``: weights are gathered for every forward and backward and freed after them, and
    gradients reduce-scattered after every micro-batch's backward, so a process holds one layer's gathered weights
    and whole gradient at a time, its shards otherwise (``2M`` all-gathers and ``M`` reduce-scatters per layer and
    step instead of one each; schedules without a split backward). ``"auto"``: fast, unless the balancer finds that
    no split fits its ``memory_capacity`` that way but one fits the lean way; back to fast once one fits again.
    docs/memory.md says which to choose when."""
    tensor_parallel_size: int = 1
    """Processes every stage is split over (tensor parallelism, innermost in the job's mesh: consecutive ranks). Each
    pipeline layer is split by the model's ``pipeline_parallelize_layer(index, layer, tp_mesh)`` hook, or by the
    built-in plan of the reference GPT and the Hugging Face Llama / Mistral / Qwen2 / GPT-2 layers; the number of
    processes must be a multiple of ``data_parallel_size * tensor_parallel_size`` (docs/scale_out.md)."""
    timeout: float | timedelta = 300.0
    """Seconds (or a ``timedelta``) before any collective or point-to-point operation gives up."""
    heartbeat_timeout: float = 15.0
    """Seconds of silence after which a process counts as lost; the others then stop with an error naming it and
    what the job was doing (instead of waiting for ``timeout``)."""
    process_group_backend: str | None = None
    """``"gloo"`` or ``"nccl"``; ``None``: gloo on CPU, NCCL on CUDA devices."""
    checkpoint_format: str = "auto"
    """``"sharded"`` (a directory: every stage writes its own layers with ``torch.distributed.checkpoint``, any width
    reads them), ``"single"`` (one file gathered on rank 0) or ``"auto"`` (sharded when the pipeline has more than
    one stage, or under ``data_parallel="fsdp"``). Both formats load either way. Hydra sets it from
    ``checkpoint.format``."""
    auto_resume: bool = True
    """Under a job manager that restarts jobs (torchrun's elastic agent, Slurm) the process's first ``fit`` resumes
    from the newest complete checkpoint in the run's checkpoint directories, if they hold one, on whatever world the
    restart gave, without a ``ckpt_path`` (a ``ckpt_path`` older than it yields to it); elsewhere, only when the
    job was restarted (docs/reliability.md)."""
    on_peer_lost: str = "stop"
    """What the job does when one of its processes dies: ``"stop"`` (every process exits within
    ``heartbeat_timeout`` naming it; with ``auto_resume`` a job manager's restart resumes from the newest checkpoint)
    or ``"recover"`` (the survivors go on without a restart: the intact replicas re-form the world, take over the lost
    replicas' data and re-run the interrupted step; needs ``data_parallel_size >= 2`` with ``ddp`` or ``replicate``,
    under torchrun; docs/reliability.md)."""
    async_checkpoint: bool = False
    """Write sharded checkpoints in the background (``torch.distributed.checkpoint.async_save``): a save copies the
    stage's tensors to host memory and training goes on while a thread writes them; the checkpoint appears at its
    name once every shard is written. The next save, a change of the world and the end of training wait for it."""
    activation_checkpointing: str | int | Policy | None = None
    """Recompute layers' activations in backward instead of keeping them: ``None`` (off), ``"all"``, ``k`` (every
    k-th layer) or ``(index, layer) -> bool`` (docs/activation_checkpointing.md)."""
    compile: bool | dict[str, Any] = False
    """Compile every pipeline layer's ``forward`` in place with ``torch.compile`` (a dict: its options, e.g.
    ``{"mode": "max-autotune-no-cudagraphs"}``; options that turn on CUDA graphs are refused); names, optimizer
    groups and checkpoint keys stay the model's, a layer that migrates is compiled on arrival
    (``pipeline/parallel/compiled.py``)."""

    def __post_init__(self) -> None:
        checks.check_arguments(
            self.n_microbatches, self.schedule, self.partition, self.stages_per_rank, self.data_parallel_size,
            self.heartbeat_timeout, self.activation_checkpointing, self.data_parallel, self.tensor_parallel_size,
        )  # fmt: skip
        if not isinstance(self.partition, str):  # a Hydra ListConfig, a tuple: plain integers
            self.partition = [int(n) for n in self.partition]
        check_options(self.compile)
        check_on_peer_lost(self.on_peer_lost, self.data_parallel, self.data_parallel_size, self.tensor_parallel_size)
        checks.check_fsdp_memory(self.fsdp_memory, self.data_parallel, self.schedule)
        if self.checkpoint_format not in sharded.FORMATS:
            raise ValueError(f"checkpoint.format={self.checkpoint_format!r} is not one of {list(sharded.FORMATS)}")

    @property
    def timeout_delta(self) -> timedelta:
        """:attr:`timeout` as a ``timedelta``."""
        return self.timeout if isinstance(self.timeout, timedelta) else timedelta(seconds=float(self.timeout))


#: The Lightning plugins a strategy takes besides its settings (as ``DDPStrategy`` does); the Trainer sets them.
PLUGINS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


@dataclasses.dataclass(kw_only=True)
class StrategyArguments(StrategySettings):
    """Every keyword argument of :class:`~dynmo_lightning.DynMoStrategy`: its settings and Lightning's plugins.

    Only its signature is used (what ``DynMoStrategy(...)`` accepts); the plugins are usually left to the Trainer.
    """

    accelerator: Accelerator | None = None
    """The accelerator (the Trainer's ``accelerator``)."""
    parallel_devices: list[torch.device] | None = None
    """This node's devices, one per process (the Trainer's ``devices``)."""
    cluster_environment: ClusterEnvironment | None = None
    """Where ranks and addresses come from: Lightning's launcher, torchrun, Slurm."""
    checkpoint_io: CheckpointIO | None = None
    """Writes and reads checkpoint files (wrapped to write atomically)."""
    precision_plugin: Precision | None = None
    """The precision plugin (wrapped to clip by the norm over all stages)."""
