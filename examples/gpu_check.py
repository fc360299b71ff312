"""The prepared GPU check: the first command to run on a GPU machine; one JSON summary (the same code runs on CPU).

    python examples/gpu_check.py --part 1   # on the GPU (CUDA): about 3 minutes on one H100/H200 (estimated)
    python examples/gpu_check.py --part 2   # the other sections: about 2.5 minutes (estimated)
    python examples/gpu_check.py            # both parts in one call
    python examples/gpu_check.py --device cpu --quick  # the same path on CPU at tiny sizes (what the test suite runs)

Its sections come in two parts (:data:`PARTS`), one call each, so that a device lent for minutes runs each in one
call of at most 5 minutes (:data:`ESTIMATED_SECONDS`: estimates from the sizes, until a device run confirms them);
``--part N`` writes ``gpu_check_partN.json``, ``--sections a,b`` runs sections of either part. It needs torch
(>= 2.11), lightning, torchmetrics and, for its Hugging Face section, transformers; not Hydra. Every section is
independent: its result, or its error (type, message, the end of the traceback), goes into ``--out``, which is
rewritten after every section, so a run cut short keeps what finished (``pending``: the sections it did not reach).
A section that cannot run here (it needs two GPUs; compiled layers on CPU without ``--compile``) reports ``ok: null``
with the reason under ``skipped``; the summary's ``ok`` is over the sections that ran (``ran``, ``skipped``). Sections
run in this process until one raises on a GPU (a device-side assert poisons the CUDA context of the process); every
later section then runs in a fresh process of its own (``--isolate``: all of them), so a failure stays its own. The
training runs clip gradients (``gradient_clip_val``: the clipping by the norm over all stages, one collective),
except the counted bf16 runs, whose host reads are the documented ones. ``docs/gpu.md`` lists what each section
checks and the value to expect.

Part 1, the pieces every run uses:

- ``refuses_16_mixed``: ``16-mixed`` is refused before training starts, and the message names ``bf16-mixed``;
- ``device_vs_cpu``: fp32 training on the device against the same training on CPU, from the same weights (layers are
  initialised on the host and copied to their device), both clipping gradients (the clipping changes the losses);
- ``bf16_vs_fp32``: ``bf16-mixed`` against fp32 on the device;
- ``dynamics.<name>``: each dynamic (``dynmo_lightning.bench.timeline.PRESETS``) trained in ``bf16-mixed``, with the
  host reads per step (``HostSyncCounter``), the synchronisations CUDA's sync debug mode reports with their call sites,
  and the counter's dispatch-mode counts where it has them;
- ``profile``: DynMo's layer profile of one step against ``torch.profiler``'s device time and a device-clock span;
- ``migration``: a layer and its AdamW state (foreach and fused) packed and unpacked as a migration moves them; one
  more optimizer step on both copies is bit-identical;
- ``hf_pruning``: structured pruning of a tiny Hugging Face Llama on the device;
- ``activation_checkpointing``: P = 1 with every layer recomputed in backward (``activation_checkpointing="all"``):
  the losses of the same run without;
- ``layer_costs``: the layer cost table of the simulator (``dynmo_lightning.bench.layer_costs``) at LLM size in bf16;
- ``memory``: short fp32 and bf16-mixed runs under ddp and fsdp at P = 1: every stage's allocator peaks
  (``max_memory_allocated``, ``max_memory_reserved``, reset at a step boundary after warm-up; ``null`` on CPU)
  beside the memory model's prediction from the run's own layer profile (the balancer's path), and their ratio
  (reported, not judged).

Part 2, sharded stages, checkpoints and compiled layers:

- ``fsdp``: ``data_parallel="fsdp"`` at P = 1 on one device (a mesh of one): DTensor parameters kept in fp32 with
  FSDP2's bf16 mixed precision, the loss curve within bf16's tolerance of fp32's;
- ``fsdp_migration``: an FSDP2 unit with its AdamW state (foreach and fused) on a one-process mesh of the device,
  packed and adopted as a migration moves it (the receiver makes it a unit again); one more step on both copies is
  bit-identical;
- ``checkpoint`` and ``checkpoint_fsdp``: a sharded checkpoint (DCP; under fsdp of DTensors) saved and resumed on the
  device; the resumed losses equal the uninterrupted run;
- ``compile`` and ``compile_fsdp`` (on GPUs, or ``--compile``): every layer compiled, plain and under fsdp, against
  the eager run; no graph compiled after the first steps;
- ``fsdp_two_gpus`` and ``tensor_parallel_two_gpus`` (two or more GPUs, or CPU): P = 1, D = 2 under fsdp and P = 1,
  T = 2 in two fresh processes against the fp32 run of one device;
- ``pipeline_p2`` (two or more GPUs, or ``--pipeline``): P = 2 over NCCL (gloo on CPU) with a migration and a shrink
  to one rank, against P = 1. NCCL refuses two ranks on one GPU and gloo cannot send CUDA tensors, so one GPU checks
  P = 1 and the in-process pieces only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import dynmo_lightning
from dynmo_lightning import DynMoStrategy
from dynmo_lightning.balance import CostTracker, MemoryModel
from dynmo_lightning.bench import layer_costs
from dynmo_lightning.bench.timeline import PRESETS, Losses
from dynmo_lightning.callbacks import GradualPruning, HostSyncCounter, syncs
from dynmo_lightning.core.parts import local_part
from dynmo_lightning.data import VOCAB_SIZE, StdlibCharDataModule
from dynmo_lightning.launch import clean_env, fresh_world, run_ranks
from dynmo_lightning.models import GPT
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.pipeline.parallel.compiled import graphs
from dynmo_lightning.pipeline.parallel.data_parallel import StageSharding
from dynmo_lightning.pipeline.stage.migration import add_to_optimizers, pack_layers, unpack_layers
from dynmo_lightning.pipeline.topology.world import FixedWorld
from dynmo_lightning.profiling import DeviceClock

MICROBATCHES = 2
#: ``gradient_clip_val`` of the training runs (not the counted ones): small enough that the clipping acts.
CLIP = 0.5
#: Seconds a section run in a process of its own may take (the largest, on a GPU, take about a minute).
ISOLATED_TIMEOUT = 900
#: The check's GPT (losses, dynamics, checkpoints) and the larger one whose step the profilers compare and whose
#: memory the ``memory`` section measures, by --quick.
GPT_SIZES = {True: {"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 64},
             False: {"n_layer": 8, "n_embd": 256, "n_head": 4, "block_size": 256}}  # fmt: skip
PROFILE_SIZES = {True: GPT_SIZES[True], False: {"n_layer": 8, "n_embd": 1024, "n_head": 16, "block_size": 1024}}
#: Steps of the ``memory`` runs: step 0 warms up (AdamW's state is made), step 1 is profiled (the layer costs the
#: prediction is made of), the allocator's peaks are reset at the start of step 2 and read after every later step.
MEMORY_STEPS = 5
#: The layer cost table's shape: LLM size on the device (quick: tiny), and the seconds every timing runs for.
LAYER_SHAPES = {True: layer_costs.LayerShape(hidden=32, heads=2, seq=32, vocab=64, n_experts=4, attn_block=8),
                False: layer_costs.LayerShape(hidden=4096, heads=32, seq=4096, vocab=32000, n_experts=8)}  # fmt: skip
LAYER_COST_SECONDS = {True: 0.01, False: 0.1}
#: Largest relative loss difference accepted: fp32 on two devices (first step: the same weights, one forward; all
#: steps: kernels that sum in another order, compounded by training; TF32 matmuls widen both), bf16 against fp32, and
#: runs that must do the same arithmetic (a resumed run, P = 2, D = 2 or T = 2 against one process). On CPU that is
#: the suite's 1e-5: a row-parallel matmul or a reduce-scatter sums fp32 in another order (~1e-6 after 12 steps). On
#: CUDA ten times that: atomics (the embedding's backward, NCCL's reduction order) add run-to-run rounding noise.
TOLERANCES = {"first_step": {"highest": 1e-4, "tf32": 1e-3}, "all_steps": {"highest": 1e-3, "tf32": 1e-2},
              "bf16": 5e-2, "same_math": {"cpu": 1e-5, "cuda": 1e-4}}  # fmt: skip
#: The two calls of the check on a device lent for minutes (``--part 1``, ``--part 2``): every section in exactly one
#: part (``dynamics``: every ``dynamics.<name>``), in the order they run; without ``--part``, both, one after the other.
PARTS = {
    1: ("refuses_16_mixed", "device_vs_cpu", "bf16_vs_fp32", "dynamics", "profile", "migration", "hf_pruning",
        "activation_checkpointing", "layer_costs", "memory"),
    2: ("fsdp", "fsdp_migration", "checkpoint", "checkpoint_fsdp", "compile", "compile_fsdp", "fsdp_two_gpus",
        "tensor_parallel_two_gpus", "pipeline_p2"),
}  # fmt: skip
#: Estimated seconds of every section on one H100/H200 (``dynamics``: per dynamic), from its sizes: a fit of the
#: check's GPT about 4 s (Trainer set-up and 12 Python-bound steps), the first fit of a process 10 s more (CUDA,
#: cuBLAS, NCCL), a fit on the CPU about 6 s, ``profile`` and ``memory`` 4-5 steps of the 8 x 1024 GPT (~0.1 s each),
#: ``layer_costs`` 41 trainable timings of about 5 x 0.1 s, a first inductor compile of the three layer kinds ~40 s.
#: Not yet confirmed by a device run (docs/gpu.md). Sections that need two GPUs are 0 here (skipped on one):
#: :data:`TWO_GPU_SECONDS` with two.
ESTIMATED_SECONDS = {
    "refuses_16_mixed": 2, "device_vs_cpu": 25, "bf16_vs_fp32": 6, "dynamics": 6, "profile": 12, "migration": 2,
    "hf_pruning": 10, "activation_checkpointing": 4, "layer_costs": 30, "memory": 20,
    "fsdp": 20, "fsdp_migration": 3, "checkpoint": 10, "checkpoint_fsdp": 10, "compile": 45, "compile_fsdp": 35,
    "fsdp_two_gpus": 0, "tensor_parallel_two_gpus": 0, "pipeline_p2": 0,
}  # fmt: skip
TWO_GPU_SECONDS = {"fsdp_two_gpus": 30, "tensor_parallel_two_gpus": 30, "pipeline_p2": 40}
#: A process's start on the GPU machine: importing torch, Lightning and the package, and the CUDA context.
STARTUP_SECONDS = 20
#: Where this package's code lives (the call sites of synchronisations are reported relative to its parent), and
#: the module of ``HostSyncCounter``, whose wrappers of ``Tensor.item`` and friends only forward a call.
PACKAGE = Path(dynmo_lightning.__file__).resolve().parent
COUNTER = Path(syncs.__file__).resolve()


@dataclasses.dataclass(frozen=True)
class Device:
    """Everything device-specific of the check in one place: Lightning's name for it, its clock and profiler, bf16.

    Attributes:
        name: ``"cuda"`` or ``"cpu"``.
    """

    name: str

    @property
    def cuda(self) -> bool:
        """Whether this is a GPU."""
        return torch.device(self.name).type == "cuda"

    @property
    def accelerator(self) -> str:
        """The Trainer's ``accelerator``."""
        return "gpu" if self.cuda else "cpu"

    def clock(self) -> DeviceClock:
        """The profiler's clock: CUDA events on a GPU (read after a synchronisation), ``perf_counter`` on CPU."""
        return DeviceClock(torch.device(self.name))

    def autocast_bf16(self) -> AbstractContextManager:
        """bf16 autocast, as ``precision="bf16-mixed"`` runs a step."""
        return torch.autocast(torch.device(self.name).type, dtype=torch.bfloat16)

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What ``torch.profiler`` records: the host, and the GPU's kernels on a GPU."""
        cuda = [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
        return [torch.profiler.ProfilerActivity.CPU, *cuda]

    def profiled_seconds(self, prof: torch.profiler.profile) -> float:
        """The device's busy time in a profile: CUDA kernel time on a GPU, the operators' own time on CPU."""
        events = prof.key_averages()
        if self.cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            return sum(e.self_device_time_total for e in kernels) / 1e6
        return sum(e.self_cpu_time_total for e in events) / 1e6

    def matmul_precision(self) -> str:
        """``"tf32"`` when fp32 matmuls may use TF32 on this device, else ``"highest"`` (what tolerances depend on)."""
        relaxed = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
        return "tf32" if self.cuda and relaxed else "highest"

    def synchronize(self) -> None:
        """Wait for the device: an asynchronous CUDA error then surfaces in the section that caused it."""
        if self.cuda:
            torch.cuda.synchronize()

    def reset(self) -> None:
        """Undo what a section may leave on, so that the next one (its timings included) starts from the defaults.

        That is deterministic algorithms (a Trainer's ``deterministic``) and CUDA's sync debug mode (a fit that failed
        half-way).
        """
        torch.use_deterministic_algorithms(False)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")

    def describe(self) -> dict[str, Any]:
        """The machine the numbers come from."""
        info = {"device": self.name, "torch": torch.__version__, "lightning": lightning.__version__,
                "python": platform.python_version(),
                "matmul_precision": torch.get_float32_matmul_precision()}  # fmt: skip
        if self.cuda:
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
        return info


@dataclasses.dataclass
class Check:
    """One run of the check: its device and sizes, and the training runs sections share (each made once).

    Attributes:
        pipeline: run ``pipeline_p2`` (P = 2 in two processes: two GPUs, or gloo on CPU).
        compile_layers: run the compiled sections (on CPU they compile for minutes).
    """

    device: Device
    steps: int
    quick: bool
    pipeline: bool = False
    compile_layers: bool = False
    runs: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Training: every fit in a world of its own (a CUDA run's NCCL group must not carry over to the CPU run after it)
# ---------------------------------------------------------------------------------------------------------------------
def gpt(sizes: dict[str, int]) -> GPT:
    """The check's GPT: its layers initialised on the host from seed 0, so every device starts from these weights."""
    return GPT(**sizes, warmup_steps=0, tie_embeddings=False, init_seed=0)


def corpus(block_size: int, batch_size: int = 8) -> StdlibCharDataModule:
    """Batches of 8 sequences of the standard-library corpus, in a fixed order (per replica: ``batch_size``)."""
    return StdlibCharDataModule(block_size=block_size, batch_size=batch_size, max_bytes=400_000, seed=0)


def fit(
    check: Check,
    model: L.LightningModule,
    data: L.LightningDataModule,
    *,
    device: Device | None = None,
    precision: str | None = "32-true",
    callbacks: list[L.Callback] | None = None,
    devices: int = 1,
    steps: int | None = None,
    deterministic: bool | str = "warn",
    strategy: dict[str, Any] | None = None,
    ckpt_path: str | None = None,
    **trainer: Any,
) -> L.Trainer:
    """Train ``model`` on ``data`` under DynMoStrategy (P = ``devices``) in a fresh world; returns the Trainer."""
    device = device or check.device
    callbacks = callbacks or []
    with fresh_world():
        L.seed_everything(0)
        t = L.Trainer(accelerator=device.accelerator, devices=devices, precision=precision,
                      max_steps=steps or check.steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      strategy=DynMoStrategy(n_microbatches=MICROBATCHES, **(strategy or {})),
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      deterministic=deterministic, **trainer)  # fmt: skip
        t.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return t


@dataclasses.dataclass
class Trained:
    """What sections read of a training run (not its Trainer: the run's device memory goes when it ends)."""

    losses: list[float]
    parameters: dict[str, Any]


class Parameters(L.Callback):
    """What the module's parameters are at the end of training: DTensors, their dtype, where their parts live."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Look at them."""
        params = list(pl_module.parameters())
        self.seen = {"dtensor_parameters": all(isinstance(p, DTensor) for p in params),
                     "fp32_shards": all(p.dtype == torch.float32 for p in params),
                     "parameter_devices": sorted({str(local_part(p).device) for p in params})}  # fmt: skip


def trained(
    check: Check,
    precision: str = "32-true",
    clip: float | None = CLIP,
    strategy: dict[str, Any] | None = None,
    device: Device | None = None,
) -> Trained:
    """The check's GPT trained at P = 1 under ``strategy`` (trained once, then shared by the sections that read it).

    fp32 runs use deterministic algorithms where there are (``"warn"``); bf16 runs do not.
    """
    device = device or check.device
    key = ("trained", device.name, precision, clip, tuple(sorted((strategy or {}).items())))
    if key not in check.runs:
        model, losses, params = gpt(GPT_SIZES[check.quick]), Losses(), Parameters()
        fit(check, model, corpus(model.hparams.block_size), device=device, precision=precision,
            callbacks=[losses, params], gradient_clip_val=clip, strategy=strategy,
            deterministic="warn" if precision == "32-true" else False)  # fmt: skip
        check.runs[key] = Trained(losses.values, params.seen)
    return check.runs[key]


def fp32_losses(check: Check, device: Device, clip: float | None = CLIP) -> list[float]:
    """Per-step losses of the check's GPT in fp32 on ``device``, clipping at ``clip`` (trained once, then shared)."""
    return trained(check, clip=clip, device=device).losses


def skipped(reason: str) -> dict[str, Any]:
    """The result of a section that cannot run here: ``ok`` is ``None`` (neither passed nor failed), and why."""
    return {"ok": None, "skipped": reason}


def rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two loss curves (NaN when they differ in length or one is empty)."""
    if len(a) != len(b) or not a:
        return math.nan
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def finite(values: list[float]) -> bool:
    """Whether there are values and all of them are finite."""
    return bool(values) and all(math.isfinite(v) for v in values)


# ---------------------------------------------------------------------------------------------------------------------
# Sections: each returns a JSON-ready dict whose "ok" says whether its value is the expected one
# ---------------------------------------------------------------------------------------------------------------------
def refuses_16_mixed(check: Check) -> dict[str, Any]:
    """``16-mixed`` (the plugin Lightning makes for ``precision="16-mixed"``) is refused before training starts."""
    model = gpt(GPT_SIZES[True])
    plugin = MixedPrecision("16-mixed", torch.device(check.device.name).type)
    try:
        fit(check, model, corpus(64), precision=None, plugins=[plugin], steps=1)
    except ValueError as e:
        message = str(e)
        return {"ok": "bf16-mixed" in message, "refused": True, "names_bf16_mixed": "bf16-mixed" in message,
                "message": message}  # fmt: skip
    return {"ok": False, "refused": False}


def device_vs_cpu(check: Check) -> dict[str, Any]:
    """fp32 on the device against fp32 on CPU, both from the same host-initialised weights."""
    on_device = fp32_losses(check, check.device)
    reference = list(fp32_losses(check, Device("cpu"))) if check.device.cuda else _cpu_again(check)
    matmul = check.device.matmul_precision()
    first, tol_first = rel_diff(on_device[:1], reference[:1]), TOLERANCES["first_step"][matmul]
    worst, tol_all = rel_diff(on_device, reference), TOLERANCES["all_steps"][matmul]
    clipped = rel_diff(on_device, fp32_losses(check, check.device, clip=None)) > 0  # the clipping did act
    return {"ok": first <= tol_first and worst <= tol_all and clipped, "first_step_rel_diff": first,
            "first_step_tolerance": tol_first, "max_rel_diff": worst, "tolerance": tol_all, "matmul": matmul,
            "gradient_clip_val": CLIP, "clipping_changed_losses": clipped, "losses": on_device,
            "cpu_losses": reference}  # fmt: skip


def _cpu_again(check: Check) -> list[float]:
    """On CPU the reference is a second, separate CPU run (it must give the same numbers)."""
    model, losses = gpt(GPT_SIZES[check.quick]), Losses()
    fit(check, model, corpus(model.hparams.block_size), device=Device("cpu"), callbacks=[losses],
        gradient_clip_val=CLIP)  # fmt: skip
    return losses.values


def bf16_vs_fp32(check: Check) -> dict[str, Any]:
    """``bf16-mixed`` against fp32 on the device: the loss curves agree to bf16's precision (neither clips)."""
    bf16, fp32 = counted_run(check, "none").losses, fp32_losses(check, check.device, clip=None)
    worst = rel_diff(bf16, fp32)
    return {"ok": finite(bf16) and worst <= TOLERANCES["bf16"], "max_rel_diff": worst,
            "tolerance": TOLERANCES["bf16"], "bf16_losses": bf16, "fp32_losses": fp32}  # fmt: skip


@dataclasses.dataclass
class CountedRun:
    """A bf16 training run with its host reads and synchronisations counted."""

    losses: list[float]
    counter: HostSyncCounter
    sites: SyncSites


def counted_run(check: Check, dynamic: str) -> CountedRun:
    """Train with ``dynamic`` (its preset; ``"none"``: none) in bf16, counting host reads and CUDA syncs per step."""
    key = ("counted", dynamic)
    if key not in check.runs:
        sizes = GPT_SIZES[check.quick]
        model, losses = gpt(sizes), Losses()
        counter, sites = HostSyncCounter(check.device.cuda), SyncSites()
        callbacks: list[L.Callback] = [losses, counter, sites]  # the sites after the counter: it starts each window
        if dynamic != "none":
            preset = PRESETS[dynamic]
            callbacks.insert(0, preset.make(preset.preset, check.steps, sizes["n_layer"]))
        with counter.patched():
            fit(check, model, corpus(sizes["block_size"]), precision="bf16-mixed", callbacks=callbacks,
                deterministic=False)  # fmt: skip
        check.runs[key] = CountedRun(losses.values, counter, sites)
    return check.runs[key]


def dynamic_syncs(check: Check, dynamic: str) -> dict[str, Any]:
    """One dynamic in bf16: its losses, host reads per step and where CUDA synchronised (steps after the first)."""
    run = counted_run(check, dynamic)
    counter = run.counter
    result: dict[str, Any] = {
        "ok": finite(run.losses),
        "final_loss": run.losses[-1] if run.losses else None,
        "host_syncs_per_step": counter.counts[1:],
        "of_which_optimizer_step": counter.optimizer_counts[1:],
        "cuda_syncs_per_step": [sum(s.values()) for s in run.sites.steps[1:]],
        "cuda_sync_sites": _merged(run.sites.steps[1:]),
    }
    # Ours only (Lightning's and the optimizer's apart, each read once): what docs/host_syncs.md tabulates.
    result["own_reads_per_step"] = counter.own_counts[1:]
    result["dispatch_counts"] = counter.dispatch_counts[1:]
    result["dispatch_sites"] = _merged(counter.dispatch_sites[1:])
    return result


def _merged(steps: list[dict[str, int]]) -> dict[str, int]:
    """Counts per site over all steps, most frequent first."""
    total: dict[str, int] = {}
    for step in steps:
        for site, n in step.items():
            total[site] = total.get(site, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


class SyncSites(L.Callback):
    """Where the synchronisations CUDA's sync debug mode reports come from, per training step.

    ``HostSyncCounter(cuda=True)`` turns the debug mode on for each step and counts its warnings inside
    ``warnings.catch_warnings(record=True)``, which replaces what the warnings machinery does after
    ``warnings._showwarnmsg``; every shown warning still passes that function, so this wraps it for the fit and
    records, per warning, the line that called the synchronising operation (the warning's ``file:line``) and the
    innermost frame of the stack inside ``dynmo_lightning`` (which of our lines led there). Steps are counted from one
    ``on_train_batch_start`` to the next, as the counter counts them.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._shown: Callable[[warnings.WarningMessage], None] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Wrap the function every shown warning passes."""
        self._shown = warnings._showwarnmsg  # type: ignore[attr-defined]
        warnings._showwarnmsg = self._record  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """A new step's window."""
        self.steps.append({})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Unwrap."""
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Unwrap (the fit failed)."""
        self._restore()

    def _restore(self) -> None:
        if self._shown is not None:
            warnings._showwarnmsg, self._shown = self._shown, None  # type: ignore[attr-defined]

    def _record(self, message: warnings.WarningMessage) -> None:
        if self.steps and "synchroniz" in str(message.message):
            site = sync_site(message, traceback.extract_stack()[:-1])
            self.steps[-1][site] = self.steps[-1].get(site, 0) + 1
        assert self._shown is not None
        self._shown(message)


def sync_site(message: warnings.WarningMessage, stack: traceback.StackSummary) -> str:
    """``"file:line <- ours:line (function)"``: where a warning was issued and our innermost frame on the way there.

    ``HostSyncCounter``'s wrappers of ``Tensor.item`` and friends only forward a call: a warning attributed to one is
    issued by its caller, and they are never "ours".
    """
    in_counter = [Path(f.filename).resolve() == COUNTER for f in stack]
    issued = (message.filename, message.lineno)
    if Path(message.filename).resolve() == COUNTER and any(in_counter):
        caller = stack[max(max(i for i, c in enumerate(in_counter) if c) - 1, 0)]
        issued = (caller.filename, caller.lineno)
    where = f"{_short(issued[0])}:{issued[1]}"
    ours = [
        f
        for f, c in zip(stack, in_counter, strict=True)
        if not c and Path(f.filename).resolve().is_relative_to(PACKAGE)
    ]
    if not ours:
        return where
    return f"{where} <- {_short(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"


def _short(path: str) -> str:
    """A source path from the package's parent or a ``site-packages`` directory on."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(PACKAGE.parent):
        return str(resolved.relative_to(PACKAGE.parent))
    return path.split("site-packages" + os.sep)[-1]


class StepProfile(L.Callback):
    """On one step: DynMo's layer profile, ``torch.profiler`` and a device-clock span of the step, side by side."""

    def __init__(self, step: int, device: Device) -> None:
        self.step, self.device = step, device
        self.result: dict[str, Any] = {}
        self._prof: torch.profiler.profile | None = None
        self._clock, self._start = device.clock(), None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Start DynMo's profiler, ``torch.profiler`` and the span on the chosen step."""
        if trainer.global_step == self.step:
            trainer.strategy.pipeline_control.request_profile()
            self._prof = torch.profiler.profile(activities=self.device.profiler_activities())
            self._prof.__enter__()
            self._start = self._clock.now()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Close ``torch.profiler`` if the step failed (left open, it crashes the process at exit)."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Stop them; DynMo's per-micro-batch layer times, summed, times the micro-batches, against the other two."""
        if self._prof is None:
            return
        end = self._clock.now()
        span = self._clock.elapsed(self._start, end)
        self._prof.__exit__(None, None, None)
        device_s, self._prof = self.device.profiled_seconds(self._prof), None
        layers = trainer.strategy.pipeline_control.profile_results() or {}
        per_microbatch = sum(c["fwd"] + c["bwd"] for c in layers.values())
        total = per_microbatch * MICROBATCHES
        self.result = {"layers": len(layers), "layers_per_microbatch_s": per_microbatch, "microbatches": MICROBATCHES,
                       "layers_s": total, "torch_profiler_device_s": device_s, "step_span_s": span,
                       "layers_share_of_span": total / span if span else math.nan,
                       "profiler_share_of_span": device_s / span if span else math.nan,
                       "layers_over_profiler": total / device_s if device_s else math.nan}  # fmt: skip


def profile(check: Check) -> dict[str, Any]:
    """Profile step 2 of a short bf16 run of the larger GPT (its first steps build stages and probe shapes)."""
    sizes = PROFILE_SIZES[check.quick]
    probe = StepProfile(2, check.device)
    fit(check, gpt(sizes), corpus(sizes["block_size"]), precision="bf16-mixed", callbacks=[probe], steps=4,
        deterministic=False)  # fmt: skip
    r = probe.result
    ok = bool(r) and r["layers"] == sizes["n_layer"] + 2 and 0 < r["layers_s"] <= 1.05 * r["step_span_s"]
    return {"ok": ok and r["torch_profiler_device_s"] > 0, **r}


class StepMemory(L.Callback):
    """The memory model's predicted peak of every stage beside the device allocator's peaks during training steps.

    The prediction takes the balancer's path: DynMo's layer profile of step 1 (weights, gradients, optimizer state,
    activations, inputs and weight copies per layer, gathered over the stages), smoothed by a ``CostTracker`` and
    priced by ``MemoryModel`` under the run's schedule, micro-batches and split. The allocator's peaks
    (``max_memory_allocated``, ``max_memory_reserved``) are reset at the start of step 2 and read after every later
    step; the CPU has no such statistics (``None``).
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.predicted: list[float] | None = None
        self.allocated: int | None = None
        self.reserved: int | None = None
        self.layers_per_stage: list[int] = []
        self._profiling = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Profile step 1; reset the peaks at the start of step 2."""
        if trainer.global_step == 1:
            trainer.strategy.pipeline_control.request_profile()
            self._profiling = True
        elif trainer.global_step == 2 and self.device.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """The prediction after the profiled step; the peaks so far after every step from step 2 on."""
        strategy = trainer.strategy
        if self._profiling:
            self._profiling = False
            measured = strategy.pipeline_control.profile_results()
            if measured is not None:
                tracker = CostTracker(strategy.pipeline_control.n_layers)
                tracker.update(measured)
                model = MemoryModel(tracker.layer_memory(), strategy.schedule, strategy.pipeline_control.pp_size,
                                    strategy.n_microbatches, strategy.stages_per_rank)  # fmt: skip
                self.layers_per_stage = list(strategy.pipeline_control.layers_per_stage)
                self.predicted = model.peaks(self.layers_per_stage)
        elif trainer.global_step > 2 and self.device.cuda:  # steps 2, 3, ... are done
            self.allocated, self.reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def memory(check: Check) -> dict[str, Any]:
    """Short fp32 and bf16-mixed runs under ddp and fsdp at P = 1: measured step peaks beside the predicted ones."""
    precisions = {"fp32": "32-true", "bf16": "bf16-mixed"}
    runs = {f"{mode}.{name}": _step_memory(check, mode, precision)
            for mode in ("ddp", "fsdp") for name, precision in precisions.items()}  # fmt: skip
    measured = not check.device.cuda or all(r["stages"][0]["max_memory_allocated"] for r in runs.values())
    ok = measured and all(finite(r["losses"]) and r["stages"][0]["predicted_peak_bytes"] for r in runs.values())
    return {"ok": ok, "note": "the ratios are reported, not judged (the memory model is being reworked)", **runs}


def _step_memory(check: Check, mode: str, precision: str) -> dict[str, Any]:
    """One run of :data:`MEMORY_STEPS` steps of the larger GPT; per stage, predicted and measured peak bytes.

    The measured step peak is the allocator's peak less what the device held before the fit (other sections' leftovers
    are collected first); the ratios are predicted over measured.
    """
    sizes, memory_of = PROFILE_SIZES[check.quick], StepMemory(check.device)
    gc.collect()
    before = {"allocated": 0, "reserved": 0}
    if check.device.cuda:
        torch.cuda.empty_cache()
        before = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    losses = Losses()
    fit(check, gpt(sizes), corpus(sizes["block_size"]), precision=precision, callbacks=[losses, memory_of],
        steps=MEMORY_STEPS, deterministic=False, strategy={"data_parallel": mode})  # fmt: skip
    stages = []
    for stage, predicted in enumerate(memory_of.predicted or [None]):
        row = {"stage": stage, "predicted_peak_bytes": predicted, "max_memory_allocated": memory_of.allocated,
               "max_memory_reserved": memory_of.reserved, "allocated_before_fit": before["allocated"],
               "reserved_before_fit": before["reserved"]}  # fmt: skip
        for kind in ("allocated", "reserved"):
            peak = memory_of.allocated if kind == "allocated" else memory_of.reserved
            step_peak = peak - before[kind] if peak is not None else None
            row[f"predicted_over_{kind}"] = predicted / step_peak if predicted and step_peak else None
        stages.append(row)
    return {"data_parallel": mode, "precision": precision, "layers_per_stage": memory_of.layers_per_stage,
            "stages": stages, "losses": losses.values}  # fmt: skip


def migration(check: Check) -> dict[str, Any]:
    """A block and its AdamW state through migration's pack and unpack, for the foreach and the fused optimizer."""
    results = {kind: _migrated_step(check, kind) for kind in ("foreach", "fused")}
    return {"ok": all(r["identical"] for r in results.values()), **results}


def _migrated_step(check: Check, kind: str) -> dict[str, Any]:
    """Pack a trained block with its optimizer entries, unpack it into fresh tensors, step both copies once."""
    block, x = _block(check)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, **{kind: True})
    optimizer = make(_groups(list(block.parameters())))
    for _ in range(2):
        _gradients(block, x)
        optimizer.step()
    device = next(block.parameters()).device
    blob, tensors = pack_layers({0: block}, [optimizer], device)
    wire = [torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for t in tensors]  # as the receiver allocates
    copy, entries = unpack_layers(blob, wire)[0]
    # The receiver's optimizer already optimizes its own layers (here: placeholders without gradients).
    receiver = make(_groups([torch.nn.Parameter(torch.zeros(*shape, device=device)) for shape in ((2, 2), (2,))]))
    add_to_optimizers(copy, entries, [receiver])
    state_arrived = _same(block, optimizer, copy, receiver)
    # One gradient for both copies: the check is the optimizer state's journey, not autograd's determinism.
    _gradients(block, x)
    for p, q in zip(block.parameters(), copy.parameters(), strict=True):
        q.grad = p.grad.clone()
    optimizer.step()
    receiver.step()
    worst = max((p - q).abs().max().item() for p, q in zip(block.parameters(), copy.parameters(), strict=True))
    step = next(iter(optimizer.state.values()))["step"]
    return {"identical": state_arrived and _same(block, optimizer, copy, receiver), "state_arrived": state_arrived,
            "max_abs_diff": worst, "tensors": len(tensors), "step_counter_on": str(step.device)}  # fmt: skip


def _block(check: Check) -> tuple[Block, torch.Tensor]:
    """A reference GPT block (hidden 1024; quick: 64) and an input for it, on the device, the same every time."""
    width = 64 if check.quick else 1024
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block, x = Block(width, 4 if check.quick else 16, 4 * width, 0.0, True), torch.randn(2, 64, width)
    return block.to(check.device.name), x.to(check.device.name)


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Two parameter groups, as the models make them (matrices decayed, the rest not)."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _gradients(block: torch.nn.Module, x: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    block(x).float().square().mean().backward()


def _same(a: torch.nn.Module, opt_a: torch.optim.Optimizer, b: torch.nn.Module, opt_b: torch.optim.Optimizer) -> bool:
    """Bit-identical parameters and optimizer state (moments and step counts) of two copies of a layer.

    DTensors are compared by their local parts (a mesh of one: the whole tensor).
    """
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        if not torch.equal(local_part(p), local_part(q)) or sa.keys() != sb.keys():
            return False
        if not all(torch.equal(_plain(sa[k]), _plain(sb[k])) for k in sa):
            return False
    return True


def _plain(value: Any) -> torch.Tensor:
    """An optimizer state entry as a plain CPU tensor (a DTensor's local part)."""
    return local_part(value).cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def fsdp_migration(check: Check) -> dict[str, Any]:
    """An FSDP2 unit and its AdamW state (foreach and fused) packed, adopted and stepped on a one-process mesh."""
    with one_process_mesh(check.device) as mesh:
        results = {kind: _adopted_step(check, mesh, kind) for kind in ("foreach", "fused")}
    ok = all(r["identical"] and r["unit"] and r["same_forward"] and r["sharded_gradients"] for r in results.values())
    return {"ok": ok, **results}


@contextlib.contextmanager
def one_process_mesh(device: Device) -> Iterator[DeviceMesh]:
    """A ``DeviceMesh`` of this process alone on ``device`` (``("dp",)``, NCCL on CUDA, gloo on CPU).

    The default process group is made for it (a one-process store) and ended after, unless one exists already.
    """
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if device.cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(torch.device(device.name).type, (1,), mesh_dim_names=("dp",))
    finally:
        if made:
            dist.destroy_process_group()


def _adopted_step(check: Check, mesh: DeviceMesh, kind: str) -> dict[str, Any]:
    """Train an FSDP2 block one step, pack it, adopt it as a receiver does, step both copies once more."""
    block, x = _block(check)
    # The unit StageSharding("fsdp", ...) makes of a layer in fp32 (torch's call: the check uses only the package's
    # public migration functions, whose insides change).
    fully_shard(block, mesh=mesh, reshard_after_forward=False)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, **{kind: True})
    optimizer = make(_groups(list(block.parameters())))
    _gradients(block, x)
    optimizer.step()
    device = local_part(next(block.parameters())).device
    blob, tensors = pack_layers({0: block}, [optimizer], device)
    wire = [torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for t in tensors]  # as the receiver allocates
    copy, entries = unpack_layers(blob, wire, StageSharding("fsdp", FixedWorld(mesh), device))[0]
    # The receiver's optimizer already optimizes its own units (here: a placeholder without gradients).
    placeholder = torch.nn.Linear(2, 2, device=device)
    fully_shard(placeholder, mesh=mesh)
    receiver = make(_groups(list(placeholder.parameters())))
    add_to_optimizers(copy, entries, [receiver])
    state_arrived = _same(block, optimizer, copy, receiver)
    unit = isinstance(copy, FSDPModule) and all(isinstance(p, DTensor) for p in copy.parameters())
    with torch.no_grad():  # the adopted unit runs as the original
        same_forward = torch.equal(block(x), copy(x))
    _gradients(copy, x)
    sharded_grads = all(isinstance(q.grad, DTensor) for q in copy.parameters())
    # One gradient for both copies: the check is the optimizer state's journey, not autograd's determinism.
    _gradients(block, x)
    for p, q in zip(block.parameters(), copy.parameters(), strict=True):
        q.grad = p.grad.clone()
    optimizer.step()
    receiver.step()
    worst = max((local_part(p) - local_part(q)).abs().max().item()
                for p, q in zip(block.parameters(), copy.parameters(), strict=True))  # fmt: skip
    step = next(iter(optimizer.state.values()))["step"]
    return {"identical": state_arrived and _same(block, optimizer, copy, receiver), "state_arrived": state_arrived,
            "unit": unit, "same_forward": same_forward, "sharded_gradients": sharded_grads, "max_abs_diff": worst,
            "tensors": len(tensors), "step_counter_on": str(step.device)}  # fmt: skip


def hf_pruning(check: Check) -> dict[str, Any]:
    """Structured pruning (``GradualPruning``) of a tiny Hugging Face Llama on the device, in bf16."""
    from dynmo_lightning.models.hf import from_hf

    hidden, seq = (32, 32) if check.quick else (256, 256)
    config = {"model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": seq}  # fmt: skip
    model, losses = from_hf(config, seed=0, lr=1e-3), Losses()
    pruning = GradualPruning(final_sparsity=0.5, start_step=1, end_step=max(2, check.steps - 2), every_n_steps=1)
    fit(check, model, corpus(seq), precision="bf16-mixed", callbacks=[pruning, losses], deterministic=False)
    neurons = [layer.mlp_units.n_units() for layer in model.layers]
    groups = [layer.attn_units.n_units() for layer in model.layers]
    pruned = sum(neurons) < len(neurons) * 2 * hidden
    return {"ok": finite(losses.values) and pruned, "losses": losses.values, "pruned": pruned,
            "mlp_units_per_layer": neurons, "kv_groups_per_layer": groups}  # fmt: skip


def checkpoint(check: Check) -> dict[str, Any]:
    """Save a sharded checkpoint at the end of the first epoch, resume from it: the losses equal the uninterrupted."""
    return _resumed(check, {})


def checkpoint_fsdp(check: Check) -> dict[str, Any]:
    """The same under ``data_parallel="fsdp"`` (a mesh of one): DCP writes and reads the DTensors of the device."""
    result = _resumed(check, {"data_parallel": "fsdp"})
    return {**result, "ok": result["ok"] and result["resumed_parameters"]["dtensor_parameters"]}


def _resumed(check: Check, strategy: dict[str, Any]) -> dict[str, Any]:
    """:func:`checkpoint` under ``strategy`` (fp32, P = 1, ``checkpoint_format="sharded"``)."""
    half, sizes = max(2, check.steps // 2), GPT_SIZES[check.quick]
    run = {"steps": 2 * half, "limit_train_batches": half,
           "strategy": {"checkpoint_format": "sharded", **strategy}}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        uninterrupted = Losses()
        saver = ModelCheckpoint(dirpath=d, filename="step{step}", auto_insert_metric_name=False,
                                every_n_train_steps=half, save_top_k=-1)  # fmt: skip
        fit(check, gpt(sizes), corpus(sizes["block_size"]), callbacks=[uninterrupted, saver], **run)
        path = Path(d) / f"step{half}.ckpt"
        sharded = path.is_dir()
        files = sorted(f.name for f in path.iterdir()) if sharded else []
        resumed, params = Losses(), Parameters()
        fit(check, gpt(sizes), corpus(sizes["block_size"]), callbacks=[resumed, params], ckpt_path=str(path), **run)
    worst, tol = rel_diff(resumed.values, uninterrupted.values[half:]), _same_math(check.device)
    return {"ok": sharded and worst <= tol, "sharded": sharded, "files": files, "max_rel_diff": worst,
            "tolerance": tol, "resumed_parameters": params.seen, "resumed_losses": resumed.values,
            "uninterrupted_losses": uninterrupted.values}  # fmt: skip


def _same_math(device: Device) -> float:
    return TOLERANCES["same_math"]["cuda" if device.cuda else "cpu"]


def activation_checkpointing(check: Check) -> dict[str, Any]:
    """P = 1, every layer recomputed in backward: the fp32 losses of the same run without recomputation."""
    model, losses = gpt(GPT_SIZES[check.quick]), Losses()
    fit(check, model, corpus(model.hparams.block_size), callbacks=[losses], gradient_clip_val=CLIP,
        strategy={"activation_checkpointing": "all"})  # fmt: skip
    worst, tol = rel_diff(losses.values, fp32_losses(check, check.device)), _same_math(check.device)
    return {"ok": finite(losses.values) and worst <= tol, "activation_checkpointing": "all",
            "max_rel_diff_vs_without": worst, "tolerance": tol, "losses": losses.values}  # fmt: skip


class GraphsPerStep(L.Callback):
    """Graphs ``torch.compile`` compiled in this process during each training step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._seen = graphs()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        self.per_step.append(graphs() - self._seen)
        self._seen += self.per_step[-1]


def compiled(check: Check) -> dict[str, Any]:
    """P = 1, bf16-mixed, every layer compiled (``strategy.compile``): the eager bf16 losses, no recompiles later."""
    return _compiled_against_eager(check, {})


def compiled_fsdp(check: Check) -> dict[str, Any]:
    """The same with ``data_parallel="fsdp"`` (a mesh of one): compiled forwards inside FSDP2's hooks."""
    return _compiled_against_eager(check, {"data_parallel": "fsdp"})


def _compiled_against_eager(check: Check, strategy: dict[str, Any]) -> dict[str, Any]:
    """The compiled bf16 run under ``strategy`` against the eager one (the ``fsdp`` section's, under fsdp)."""
    if not check.compile_layers:
        return skipped("compiled layers compile for minutes on CPU: --compile runs them")
    model, losses, counted = gpt(GPT_SIZES[check.quick]), Losses(), GraphsPerStep()
    fit(check, model, corpus(model.hparams.block_size), precision="bf16-mixed", callbacks=[losses, counted],
        deterministic=False, strategy={**strategy, "compile": True}, gradient_clip_val=CLIP)  # fmt: skip
    eager = trained(check, "bf16-mixed", strategy=strategy).losses
    worst, tol = rel_diff(losses.values, eager), TOLERANCES["bf16"]
    later = counted.per_step[2:]  # steps 0 and 1 build the stages, probe shapes and compile
    return {"ok": finite(losses.values) and worst <= tol and sum(counted.per_step) > 0 and not any(later),
            "max_rel_diff_vs_eager": worst, "tolerance": tol, "graphs_per_step": counted.per_step,
            "losses": losses.values, "eager_losses": eager}  # fmt: skip


def layer_cost_table(check: Check) -> dict[str, Any]:
    """The simulator's layer cost table measured on the device in bf16 (autocast, as bf16-mixed training runs)."""
    shape = LAYER_SHAPES[check.quick]
    with check.device.autocast_bf16():
        table = layer_costs.measure(shape, device=check.device.name, min_run_time=LAYER_COST_SECONDS[check.quick])
    block = table["block"]["trainable"]
    return {"ok": block["fwd"] > 0 and block["bwd"] > 0, "precision": "bf16-mixed (autocast)", "table": table}


def pipeline_p2(check: Check) -> dict[str, Any]:
    """P = 2 (NCCL on two GPUs, gloo on CPU) in two fresh processes, moving layers and shrinking, against P = 1."""
    if not check.pipeline:
        return skipped(_two_processes(check))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "p2.json"
        argv = [sys.executable, __file__, "--worker", str(out), "--device", check.device.name, "--steps",
                str(check.steps), *(["--quick"] if check.quick else [])]  # fmt: skip
        codes = run_ranks(2, argv, log_dir=Path(d), tag="p2", timeout=300)
        if any(c != 0 for c in codes) or not out.exists():
            logs = "".join((Path(d) / f"p2.rank{r}.log").read_text()[-2000:] for r in range(2))
            return {"ok": False, "exit_codes": codes, "log": logs}
        p2 = json.loads(out.read_text())
    worst, tol = rel_diff(p2["losses"], fp32_losses(check, check.device)), _same_math(check.device)
    moved = len(p2["partitions"]) >= 3  # the initial split, the migration, the shrink
    return {"ok": worst <= tol and moved and p2["world_size_end"] == 1, "max_rel_loss_diff_vs_p1": worst,
            "tolerance": tol, **p2}  # fmt: skip


def fsdp(check: Check) -> dict[str, Any]:
    """``data_parallel="fsdp"`` on one device in ``bf16-mixed``: DTensor parameters, fp32 shards, bf16 compute."""
    run = trained(check, "bf16-mixed", strategy={"data_parallel": "fsdp"})
    worst, p = rel_diff(run.losses, fp32_losses(check, check.device)), run.parameters
    return {"ok": p["dtensor_parameters"] and p["fp32_shards"] and finite(run.losses) and worst <= TOLERANCES["bf16"],
            **p, "max_rel_diff_vs_fp32": worst, "tolerance": TOLERANCES["bf16"], "losses": run.losses}  # fmt: skip


def fsdp_two_gpus(check: Check) -> dict[str, Any]:
    """P = 1, D = 2 under fsdp in two fresh processes (one GPU each), against fp32 on one device."""
    return _two_gpus(check, "fsdp")


def tensor_parallel_two_gpus(check: Check) -> dict[str, Any]:
    """P = 1, T = 2 (every layer's heads and MLP split over two processes, one GPU each), against fp32 on one."""
    return _two_gpus(check, "tp")


def _two_gpus(check: Check, kind: str) -> dict[str, Any]:
    """:func:`worker` of ``kind`` in two fresh processes (one GPU each), against fp32 on one device."""
    if check.device.cuda and torch.cuda.device_count() < 2:
        return skipped(_two_processes(check))
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / f"{kind}2.json"
        argv = [sys.executable, __file__, "--worker", str(out), "--worker-kind", kind, "--device",
                check.device.name, "--steps", str(check.steps), *(["--quick"] if check.quick else [])]  # fmt: skip
        codes = run_ranks(2, argv, log_dir=Path(d), tag=f"{kind}2", timeout=300)
        if any(c != 0 for c in codes) or not out.exists():
            logs = "".join((Path(d) / f"{kind}2.rank{r}.log").read_text()[-2000:] for r in range(2))
            return {"ok": False, "exit_codes": codes, "log": logs}
        run = json.loads(out.read_text())
    worst, tol = rel_diff(run["losses"], fp32_losses(check, check.device)), _same_math(check.device)
    return {"ok": worst <= tol, "max_rel_loss_diff_vs_one_device": worst, "tolerance": tol, **run}


def _two_processes(check: Check) -> str:
    """Why a section of two processes does not run here."""
    if check.device.cuda:
        return "needs two GPUs: each process runs on its own (NCCL refuses two ranks on one)"
    return "P = 2 on CPU: --pipeline runs it"


class Resize(L.Callback):
    """Move a layer at a third of the run (a migration), consolidate onto rank 0 at two thirds (a shrink)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Act at the two steps."""
        strategy, step = trainer.strategy, trainer.global_step
        if step == self.steps // 3:
            first, second = strategy.pipeline_control.layers_per_stage
            strategy.pipeline_control.repartition([first - 1, second + 1] if first > 1 else [first + 1, second - 1])
        elif step == 2 * self.steps // 3 and strategy.world_size > 1:
            strategy.pipeline_control.shrink([0], [strategy.pipeline_control.n_layers])


def worker(out: Path, device: str, steps: int, quick: bool, kind: str = "pipeline") -> None:
    """One rank of :func:`pipeline_p2` (the fp32 run of :func:`fp32_losses` at P = 2, moved and shrunk), of
    :func:`fsdp_two_gpus` (``kind="fsdp"``: the same run at P = 1, D = 2 under fsdp, half the batch per replica) or
    of :func:`tensor_parallel_two_gpus` (``kind="tp"``: at P = 1, T = 2, the whole batch on both)."""
    check = Check(Device(device), steps, quick)
    model, losses = gpt(GPT_SIZES[quick]), Losses()
    if kind in ("fsdp", "tp"):
        fsdp = kind == "fsdp"  # replicas take half the batch each; tensor-parallel processes the same batch
        strategy = {"data_parallel": "fsdp", "data_parallel_size": 2} if fsdp else {"tensor_parallel_size": 2}
        trainer = fit(check, model, corpus(model.hparams.block_size, batch_size=4 if fsdp else 8), devices=2,
                      callbacks=[losses], strategy=strategy, gradient_clip_val=CLIP)  # fmt: skip
        if trainer.global_rank == 0:
            out.write_text(json.dumps({"losses": losses.values, "replicas": trainer.strategy.pipeline_control.dp_size,
                                       "tensor_parallel_size": trainer.strategy.tensor_parallel_size}))  # fmt: skip
        return
    trainer = fit(check, model, corpus(model.hparams.block_size), devices=2, callbacks=[losses, Resize(steps)],
                  gradient_clip_val=CLIP)  # fmt: skip
    if trainer.global_rank == 0:  # the released rank left during training
        result = {"losses": losses.values, "partitions": trainer.strategy.pipeline_control.partitions,
                  "world_size_end": trainer.world_size}  # fmt: skip
        out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# The summary: one section after the other, each one's result or error written as soon as it is known
# ---------------------------------------------------------------------------------------------------------------------
#: Every section but the dynamics by name (their parts and order: :data:`PARTS`).
SECTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "refuses_16_mixed": refuses_16_mixed, "device_vs_cpu": device_vs_cpu, "bf16_vs_fp32": bf16_vs_fp32,
    "profile": profile, "migration": migration, "hf_pruning": hf_pruning,
    "activation_checkpointing": activation_checkpointing, "layer_costs": layer_cost_table, "memory": memory,
    "fsdp": fsdp, "fsdp_migration": fsdp_migration, "checkpoint": checkpoint, "checkpoint_fsdp": checkpoint_fsdp,
    "compile": compiled, "compile_fsdp": compiled_fsdp, "fsdp_two_gpus": fsdp_two_gpus,
    "tensor_parallel_two_gpus": tensor_parallel_two_gpus, "pipeline_p2": pipeline_p2,
}  # fmt: skip


def sections(dynamics: list[str], part: int | None = None) -> dict[str, Callable[[Check], dict[str, Any]]]:
    """The sections of ``part`` (``None``: of both parts, the first part's first), in the order they run."""
    chosen: dict[str, Callable[[Check], dict[str, Any]]] = {}
    for number, names in PARTS.items():
        if part in (None, number):
            for name in names:
                if name == "dynamics":
                    chosen.update({f"dynamics.{d}": functools.partial(dynamic_syncs, dynamic=d) for d in dynamics})
                else:
                    chosen[name] = SECTIONS[name]
    return chosen


def estimated_seconds(names: list[str], gpus: int = 1) -> int:
    """The estimated seconds of running ``names`` in one process on one H100/H200 (``gpus`` of them), start included."""
    per = {**ESTIMATED_SECONDS, **(TWO_GPU_SECONDS if gpus >= 2 else {})}
    return STARTUP_SECONDS + sum(per[name.partition(".")[0]] for name in names)


def run_section(check: Check, run: Callable[[Check], dict[str, Any]]) -> dict[str, Any]:
    """Run one section; an exception becomes its result (type, message, the end of the traceback)."""
    t0 = time.perf_counter()
    try:
        result = run(check)
        check.device.synchronize()
    except Exception as e:
        tail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
        result = {"ok": False, "error": {"type": type(e).__name__, "message": str(e)[:2000], "traceback": tail}}
    finally:
        with contextlib.suppress(Exception):  # a broken CUDA context refuses even this; the error above says why
            check.device.reset()
    return {**result, "seconds": round(time.perf_counter() - t0, 2)}


def run_isolated(name: str, options: list[str]) -> dict[str, Any]:
    """Run section ``name`` in a fresh process (a CUDA context of its own) with ``options``: its summary's entry."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "section.json"
        cmd = [sys.executable, __file__, *options, "--sections", name, "--out", str(out)]
        try:
            proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=ISOLATED_TIMEOUT)
            ended, log = f"exit status {proc.returncode}", proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            ended, log = f"killed after {ISOLATED_TIMEOUT} s", f"{e.stdout or ''}{e.stderr or ''}"
        if out.exists():
            return {**json.loads(out.read_text())["sections"][name], "isolated": True}
    message = f"its process ended ({ended}) before the section's verdict"
    return {"ok": False, "isolated": True, "error": {"type": "ChildProcessError", "message": message,
                                                     "traceback": str(log)[-3000:]}}  # fmt: skip


def write(path: Path, summary: dict[str, Any]) -> None:
    """Replace ``path`` with ``summary`` at once (a reader, or a run killed mid-write, never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    tmp.replace(path)


def check_all(
    check: Check,
    chosen: dict[str, Callable[[Check], dict[str, Any]]],
    out: Path,
    options: list[str],
    isolate: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``chosen`` on ``check``, rewriting ``out`` after every section; returns the summary.

    Sections run in this process until one raises on a GPU (its CUDA context may be broken: a device-side assert
    fails every later kernel); from then on, and with ``isolate`` from the start, each runs in a process of its own
    started with the command-line ``options`` of this check. The summary's ``pending`` lists the sections not yet
    run (a run killed mid-way leaves them there); ``extra`` goes into the summary as it is.
    """
    extra = extra or {}
    t0 = time.perf_counter()
    summary: dict[str, Any] = {**check.device.describe(), "steps": check.steps, "quick": check.quick, **extra,
                               **verdict({}), "pending": list(chosen), "sections": {}}  # fmt: skip
    write(out, summary)
    for name, run in chosen.items():
        summary["sections"][name] = entry = run_isolated(name, options) if isolate else run_section(check, run)
        isolate = isolate or (check.device.cuda and "error" in entry)
        summary.update(verdict(summary["sections"]), pending=summary["pending"][1:])
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        write(out, summary)
        shown = {k: v for k, v in entry.items() if k != "table" and not k.endswith("losses")}
        print(f"[gpu check] {name}: {json.dumps(shown, default=str)[:1500]}", flush=True)
    return summary


def verdict(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary's verdict: ``ok`` over the sections that ran (``None`` if none did), and what was skipped.

    A skipped section (``ok: None``: it cannot run here, e.g. it needs two GPUs) neither passes nor fails.
    """
    ran = [bool(e["ok"]) for e in entries.values() if e["ok"] is not None]
    skipped = [name for name, e in entries.items() if e["ok"] is None]
    return {"ok": all(ran) if ran else None, "ran": len(ran), "skipped": len(skipped), "skipped_sections": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="tiny models and layer-cost shape (CPU, tests)")
    parser.add_argument("--dynamics", default=",".join(["none", *PRESETS]))
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--part", type=int, choices=sorted(PARTS), help="run one part (one call of about 3 minutes "
                       "on one H100/H200; default: both)")  # fmt: skip
    which.add_argument("--sections", help="comma-separated sections to run, of either part (default: all)")
    parser.add_argument("--pipeline", action="store_true", help="also P = 2 (default: with two or more GPUs)")
    parser.add_argument("--compile", action="store_true", help="also compiled layers (default: on GPUs; on CPU they "
                        "compile for minutes)")  # fmt: skip
    parser.add_argument("--out", help="the summary (default: gpu_check.json, with --part N gpu_check_partN.json)")
    parser.add_argument("--isolate", action="store_true", help="run every section in a process of its own")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-kind", default="pipeline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.device, args.steps, args.quick, args.worker_kind)
        return
    dynamics = args.dynamics.split(",")
    if set(dynamics) - {"none", *PRESETS}:
        parser.error(f"--dynamics: unknown {sorted(set(dynamics) - {'none', *PRESETS})}; use none or {list(PRESETS)}")
    device = Device(args.device)
    gpus = torch.cuda.device_count() if device.cuda else 0
    pipeline = args.pipeline or gpus >= 2
    compile_layers = args.compile or device.cuda or "compile" in (args.sections or "").split(",")
    check = Check(device, args.steps, args.quick, pipeline=pipeline, compile_layers=compile_layers)
    chosen = sections(dynamics, args.part)
    if args.sections:
        unknown = set(args.sections.split(",")) - set(chosen)
        if unknown:
            parser.error(f"--sections: unknown {sorted(unknown)}; choose from {list(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.sections.split(",")}
    options = ["--device", args.device, "--steps", str(args.steps), "--dynamics", args.dynamics,
               *(["--quick"] if args.quick else []), *(["--pipeline"] if pipeline else []),
               *(["--compile"] if compile_layers else [])]  # fmt: skip
    out = Path(args.out or (f"gpu_check_part{args.part}.json" if args.part else "gpu_check.json"))
    extra = {"part": args.part, "estimated_gpu_seconds": estimated_seconds(list(chosen), max(gpus, 1))}
    print(f"[gpu check] {len(chosen)} sections, about {extra['estimated_gpu_seconds']} s on one H100/H200 "
          f"(estimated); writing {out}", flush=True)  # fmt: skip
    summary = check_all(check, chosen, out, options, isolate=args.isolate, extra=extra)
    print(json.dumps({k: v for k, v in summary.items() if k != "sections"}, indent=1))
    sys.exit(1 if summary["ok"] is False else 0)


if __name__ == "__main__":
    main()
