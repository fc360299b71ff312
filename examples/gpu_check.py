"""The prepared GPU check: the first command to run on a GPU machine; one JSON summary (the same code runs on CPU).

    python examples/gpu_check.py                       # on the GPU (CUDA): under 6 minutes on one H200-class GPU
    python examples/gpu_check.py --device cpu --quick  # the same path on CPU at tiny sizes (what the test suite runs)

It needs torch (>= 2.9), lightning, torchmetrics and, for its Hugging Face section, transformers; not Hydra. Every
section is independent: its result, or its error (type, message, the end of the traceback), goes into ``--out``,
which is rewritten after every section, so a run cut short keeps what finished. Sections run in this process until
one raises on a GPU (a device-side assert poisons the CUDA context of the process); every later section then runs in
a fresh process of its own (``--isolate``: all of them), so a failure stays its own. The training runs clip
gradients (``gradient_clip_val``: the clipping by the norm over all stages, one collective), except the counted bf16
runs, whose host reads are the documented ones. ``docs/gpu.md`` lists what each section checks and the value to
expect:

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
- ``checkpoint``: a sharded checkpoint saved and resumed on the device; the resumed losses equal the uninterrupted run;
- ``activation_checkpointing``: P = 1 with every layer recomputed in backward (``activation_checkpointing="all"``):
  the losses of the same run without;
- ``layer_costs``: the layer cost table of the simulator (``dynmo_lightning.bench.layer_costs``) at LLM size in bf16;
- ``fsdp``: ``data_parallel="fsdp"`` at P = 1 on one device (a mesh of one): DTensor parameters kept in fp32 with
  FSDP2's bf16 mixed precision, the loss curve within bf16's tolerance of fp32's;
- ``fsdp_two_gpus`` (two or more GPUs; reported as skipped otherwise): P = 1, D = 2 under fsdp (one replica per GPU,
  half the batch each) against the fp32 run of one device;
- ``pipeline_p2`` (two or more GPUs, or ``--pipeline``): P = 2 over NCCL (gloo on CPU) with a migration and a shrink
  to one rank, against P = 1. NCCL refuses two ranks on one GPU and gloo cannot send CUDA tensors, so one GPU checks
  P = 1 and the in-process pieces only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

import dynmo_lightning
from dynmo_lightning import DynMoStrategy
from dynmo_lightning.bench import layer_costs
from dynmo_lightning.bench.timeline import PRESETS, Losses
from dynmo_lightning.callbacks import GradualPruning, HostSyncCounter, syncs
from dynmo_lightning.data import VOCAB_SIZE, StdlibCharDataModule
from dynmo_lightning.launch import clean_env, fresh_world, run_ranks
from dynmo_lightning.models import GPT
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.pipeline.compiled import graphs
from dynmo_lightning.pipeline.migration import add_to_optimizers, pack_layers, unpack_layers
from dynmo_lightning.profiling import DeviceClock

MICROBATCHES = 2
#: ``gradient_clip_val`` of the training runs (not the counted ones): small enough that the clipping acts.
CLIP = 0.5
#: Seconds a section run in a process of its own may take (the largest, on a GPU, take about a minute).
ISOLATED_TIMEOUT = 900
#: The check's GPT (losses, dynamics, checkpoints) and the larger one whose step the profilers compare, by --quick.
GPT_SIZES = {True: {"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 64},
             False: {"n_layer": 8, "n_embd": 256, "n_head": 4, "block_size": 256}}  # fmt: skip
PROFILE_SIZES = {True: GPT_SIZES[True], False: {"n_layer": 8, "n_embd": 1024, "n_head": 16, "block_size": 1024}}
#: The layer cost table's shape: LLM size on the device (quick: tiny).
LAYER_SHAPES = {True: layer_costs.LayerShape(hidden=32, heads=2, seq=32, vocab=64, n_experts=4, attn_block=8),
                False: layer_costs.LayerShape(hidden=4096, heads=32, seq=4096, vocab=32000, n_experts=8)}  # fmt: skip
#: Largest relative loss difference accepted: fp32 on two devices (first step: the same weights, one forward; all
#: steps: kernels that sum in another order, compounded by training; TF32 matmuls widen both), bf16 against fp32, and
#: runs that must do the same arithmetic (a resumed run, P = 2 against P = 1; CUDA's atomics leave rounding noise).
TOLERANCES = {"first_step": {"highest": 1e-4, "tf32": 1e-3}, "all_steps": {"highest": 1e-3, "tf32": 1e-2},
              "bf16": 5e-2, "same_math": {"cpu": 1e-6, "cuda": 1e-4}}  # fmt: skip
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
    """One run of the check: its device and sizes, and the training runs sections share (each made once)."""

    device: Device
    steps: int
    quick: bool
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


def fp32_losses(check: Check, device: Device, clip: float | None = CLIP) -> list[float]:
    """Per-step losses of the check's GPT in fp32 on ``device``, clipping at ``clip`` (trained once, then shared)."""
    key = ("fp32", device.name, clip)
    if key not in check.runs:
        model, losses = gpt(GPT_SIZES[check.quick]), Losses()
        fit(check, model, corpus(model.hparams.block_size), device=device, callbacks=[losses],
            gradient_clip_val=clip)  # fmt: skip
        check.runs[key] = losses.values
    return check.runs[key]


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
            trainer.strategy.request_profile()
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
        layers = trainer.strategy.profile_results() or {}
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


def migration(check: Check) -> dict[str, Any]:
    """A block and its AdamW state through migration's pack and unpack, for the foreach and the fused optimizer."""
    results = {kind: _migrated_step(check, kind) for kind in ("foreach", "fused")}
    return {"ok": all(r["identical"] for r in results.values()), **results}


def _migrated_step(check: Check, kind: str) -> dict[str, Any]:
    """Pack a trained block with its optimizer entries, unpack it into fresh tensors, step both copies once."""
    width = 64 if check.quick else 1024
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block, x = Block(width, 4 if check.quick else 16, 4 * width, 0.0, True), torch.randn(2, 64, width)
    block, x = block.to(check.device.name), x.to(check.device.name)
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


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Two parameter groups, as the models make them (matrices decayed, the rest not)."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def _gradients(block: torch.nn.Module, x: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    block(x).float().square().mean().backward()


def _same(a: torch.nn.Module, opt_a: torch.optim.Optimizer, b: torch.nn.Module, opt_b: torch.optim.Optimizer) -> bool:
    """Bit-identical parameters and optimizer state (moments and step counts) of two copies of a layer."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        sa, sb = opt_a.state.get(p, {}), opt_b.state.get(q, {})
        if not torch.equal(p, q) or sa.keys() != sb.keys():
            return False
        if not all(torch.equal(torch.as_tensor(sa[k]).cpu(), torch.as_tensor(sb[k]).cpu()) for k in sa):
            return False
    return True


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
    half, sizes = max(2, check.steps // 2), GPT_SIZES[check.quick]
    run = {"steps": 2 * half, "limit_train_batches": half, "strategy": {"checkpoint_format": "sharded"}}
    with tempfile.TemporaryDirectory() as d:
        uninterrupted = Losses()
        saver = ModelCheckpoint(dirpath=d, filename="step{step}", auto_insert_metric_name=False,
                                every_n_train_steps=half, save_top_k=-1)  # fmt: skip
        fit(check, gpt(sizes), corpus(sizes["block_size"]), callbacks=[uninterrupted, saver], **run)
        path = Path(d) / f"step{half}.ckpt"
        sharded = path.is_dir()
        resumed = Losses()
        fit(check, gpt(sizes), corpus(sizes["block_size"]), callbacks=[resumed], ckpt_path=str(path), **run)
    worst, tol = rel_diff(resumed.values, uninterrupted.values[half:]), _same_math(check.device)
    return {"ok": sharded and worst <= tol, "sharded": sharded, "max_rel_diff": worst, "tolerance": tol,
            "resumed_losses": resumed.values, "uninterrupted_losses": uninterrupted.values}  # fmt: skip


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
    model, losses, counted = gpt(GPT_SIZES[check.quick]), Losses(), GraphsPerStep()
    fit(check, model, corpus(model.hparams.block_size), precision="bf16-mixed", callbacks=[losses, counted],
        deterministic=False, strategy={"compile": True})  # fmt: skip
    eager = counted_run(check, "none").losses
    worst, tol = rel_diff(losses.values, eager), TOLERANCES["bf16"]
    later = counted.per_step[2:]  # steps 0 and 1 build the stages, probe shapes and compile
    return {"ok": finite(losses.values) and worst <= tol and sum(counted.per_step) > 0 and not any(later),
            "max_rel_diff_vs_eager": worst, "tolerance": tol, "graphs_per_step": counted.per_step,
            "losses": losses.values, "eager_losses": eager}  # fmt: skip


def layer_cost_table(check: Check) -> dict[str, Any]:
    """The simulator's layer cost table measured on the device in bf16 (autocast, as bf16-mixed training runs)."""
    shape = LAYER_SHAPES[check.quick]
    with check.device.autocast_bf16():
        table = layer_costs.measure(shape, device=check.device.name, min_run_time=0.01 if check.quick else 0.2)
    block = table["block"]["trainable"]
    return {"ok": block["fwd"] > 0 and block["bwd"] > 0, "precision": "bf16-mixed (autocast)", "table": table}


def pipeline_p2(check: Check) -> dict[str, Any]:
    """P = 2 (NCCL on two GPUs, gloo on CPU) in two fresh processes, moving layers and shrinking, against P = 1."""
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
    model, losses = gpt(GPT_SIZES[check.quick]), Losses()
    trainer = fit(check, model, corpus(model.hparams.block_size), precision="bf16-mixed", callbacks=[losses],
                  deterministic=False, strategy={"data_parallel": "fsdp"}, gradient_clip_val=CLIP)  # fmt: skip
    params = list(trainer.lightning_module.parameters())
    sharded = all(isinstance(p, DTensor) for p in params)
    fp32 = all(p.dtype == torch.float32 for p in params)
    devices = sorted({str(p.to_local().device) if isinstance(p, DTensor) else str(p.device) for p in params})
    worst = rel_diff(losses.values, fp32_losses(check, check.device))
    return {"ok": sharded and fp32 and finite(losses.values) and worst <= TOLERANCES["bf16"],
            "dtensor_parameters": sharded, "fp32_shards": fp32, "parameter_devices": devices,
            "max_rel_diff_vs_fp32": worst, "tolerance": TOLERANCES["bf16"], "losses": losses.values}  # fmt: skip


def fsdp_two_gpus(check: Check) -> dict[str, Any]:
    """P = 1, D = 2 under fsdp in two fresh processes (one GPU each), against fp32 on one device."""
    return _two_gpus(check, "fsdp")


def tensor_parallel_two_gpus(check: Check) -> dict[str, Any]:
    """P = 1, T = 2 (every layer's heads and MLP split over two processes, one GPU each), against fp32 on one."""
    return _two_gpus(check, "tp")


def _two_gpus(check: Check, kind: str) -> dict[str, Any]:
    """:func:`worker` of ``kind`` in two fresh processes (one GPU each), against fp32 on one device."""
    if check.device.cuda and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "needs two GPUs: each process runs on its own (NCCL refuses two ranks on one)"}
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


class Resize(L.Callback):
    """Move a layer at a third of the run (a migration), consolidate onto rank 0 at two thirds (a shrink)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Act at the two steps."""
        strategy, step = trainer.strategy, trainer.global_step
        if step == self.steps // 3:
            first, second = strategy.layers_per_stage
            strategy.repartition([first - 1, second + 1] if first > 1 else [first + 1, second - 1])
        elif step == 2 * self.steps // 3 and strategy.world_size > 1:
            strategy.shrink([0], [strategy.n_layers])


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
            out.write_text(json.dumps({"losses": losses.values, "replicas": trainer.strategy.dp_size,
                                       "tensor_parallel_size": trainer.strategy.tensor_parallel_size}))  # fmt: skip
        return
    trainer = fit(check, model, corpus(model.hparams.block_size), devices=2, callbacks=[losses, Resize(steps)],
                  gradient_clip_val=CLIP)  # fmt: skip
    if trainer.global_rank == 0:  # the released rank left during training
        result = {"losses": losses.values, "partitions": trainer.strategy.partitions,
                  "world_size_end": trainer.world_size}  # fmt: skip
        out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# The summary: one section after the other, each one's result or error written as soon as it is known
# ---------------------------------------------------------------------------------------------------------------------
def sections(
    dynamics: list[str], pipeline: bool, compile_layers: bool = True
) -> dict[str, Callable[[Check], dict[str, Any]]]:
    """The check's sections in the order they run."""
    chosen: dict[str, Callable[[Check], dict[str, Any]]] = {
        "refuses_16_mixed": refuses_16_mixed, "device_vs_cpu": device_vs_cpu, "bf16_vs_fp32": bf16_vs_fp32,
        **{f"dynamics.{d}": functools.partial(dynamic_syncs, dynamic=d) for d in dynamics},
        "profile": profile, "migration": migration, "hf_pruning": hf_pruning, "checkpoint": checkpoint,
        "activation_checkpointing": activation_checkpointing, "layer_costs": layer_cost_table, "fsdp": fsdp,
        "fsdp_two_gpus": fsdp_two_gpus,
        "tensor_parallel_two_gpus": tensor_parallel_two_gpus,
    }  # fmt: skip
    if compile_layers:
        chosen["compile"] = compiled
    if pipeline:
        chosen["pipeline_p2"] = pipeline_p2
    return chosen


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
) -> dict[str, Any]:
    """Run ``chosen`` on ``check``, rewriting ``out`` after every section; returns the summary.

    Sections run in this process until one raises on a GPU (its CUDA context may be broken: a device-side assert
    fails every later kernel); from then on, and with ``isolate`` from the start, each runs in a process of its own
    started with the command-line ``options`` of this check.
    """
    t0 = time.perf_counter()
    summary: dict[str, Any] = {**check.device.describe(), "steps": check.steps, "quick": check.quick, "sections": {}}
    for name, run in chosen.items():
        summary["sections"][name] = entry = run_isolated(name, options) if isolate else run_section(check, run)
        isolate = isolate or (check.device.cuda and "error" in entry)
        summary["ok"] = all(s["ok"] for s in summary["sections"].values())
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        write(out, summary)
        shown = {k: v for k, v in entry.items() if k != "table" and not k.endswith("losses")}
        print(f"[gpu check] {name}: {json.dumps(shown, default=str)[:1500]}", flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="tiny models and layer-cost shape (CPU, tests)")
    parser.add_argument("--dynamics", default=",".join(["none", *PRESETS]))
    parser.add_argument("--sections", help="comma-separated sections to run (default: all)")
    parser.add_argument("--pipeline", action="store_true", help="also P = 2 (default: with two or more GPUs)")
    parser.add_argument("--compile", action="store_true", help="also compiled layers (default: on GPUs; on CPU they "
                        "compile for minutes)")  # fmt: skip
    parser.add_argument("--out", default="gpu_check.json")
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
    check = Check(Device(args.device), args.steps, args.quick)
    pipeline = args.pipeline or (check.device.cuda and torch.cuda.device_count() >= 2)
    compile_layers = args.compile or check.device.cuda or "compile" in (args.sections or "").split(",")
    chosen = sections(dynamics, pipeline, compile_layers)
    if args.sections:
        unknown = set(args.sections.split(",")) - set(chosen)
        if unknown:
            parser.error(f"--sections: unknown {sorted(unknown)}; choose from {list(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.sections.split(",")}
    options = ["--device", args.device, "--steps", str(args.steps), "--dynamics", args.dynamics,
               *(["--quick"] if args.quick else []), *(["--pipeline"] if pipeline else []),
               *(["--compile"] if compile_layers else [])]  # fmt: skip
    summary = check_all(check, chosen, Path(args.out), options, isolate=args.isolate)
    print(json.dumps({k: v for k, v in summary.items() if k != "sections"}, indent=1))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
