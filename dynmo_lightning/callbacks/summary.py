"""RunSummary: the ``summary.json`` of a training run (losses, throughput, world size, partitions, norms)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.core.control import RunFacts, pipeline_control
from dynmo_lightning.core.host_values import DeviceScalars
from dynmo_lightning.pipeline.parallel.compiled import graphs
from dynmo_lightning.pipeline.stage.reduce import GlobalNormClipping
from dynmo_lightning.recompute import recomputations


class RunSummary(Callback):
    """Write ``summary.json`` into ``run_dir`` at the end of training (global rank 0 writes; all ranks compute).

    Keys: ``steps``, ``losses`` (one per optimizer step), ``final_loss``, ``val_loss``, ``tokens_per_s`` (training
    tokens per second of training time, validation excluded), ``world_size_start``, ``world_size_end``, ``world_size``
    (``[{"step", "world_size", "replicas"}]``: every change), ``replicas_end`` (data-parallel replicas at the end),
    ``replicas_in_sync`` (whether all replicas ended with bit-identical parameters and buffers), ``partitions``
    (``[{"step", "layers_per_stage"}]``, from the strategy when it splits the model), ``releases`` (every release
    of a consolidation: ranks, hosts, whole nodes freed), ``param_norm`` (float64 L2 norm
    of all final parameters, across pipeline stages), ``compiled_graphs_per_step`` (graphs ``torch.compile``
    compiled on global rank 0 during each step: the first compilations, then recompilations), ``layers_changed``
    (the steps that began after a dynamic changed layers: where a recompilation is expected),
    ``recomputations_per_step`` (forwards global rank 0 recomputed for backward in each step under activation
    checkpointing: one per checkpointed layer and micro-batch, under the zero-bubble schedules too), ``grad_norms``
    (the global gradient norm before clipping, one per optimizer step that clipped by norm under ``DynMoStrategy``:
    what ``torch.nn.utils.clip_grad_norm_`` returns for the unsplit model; empty without clipping by norm).

    Args:
        run_dir: directory of the run.

    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._losses = DeviceScalars()
        self._grad_norms = DeviceScalars()
        self._last_norm: torch.Tensor | None = None
        self.tokens = 0
        self._train_time = 0.0
        self._t0: float | None = None
        self.world_size_start = 1
        self.world_sizes: list[dict[str, int]] = []
        self.compiled: list[int] = []
        self.changed: list[int] = []
        self._graphs = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.world_size_start = trainer.world_size
        self.world_sizes = [_world(trainer)]
        self._t0 = time.perf_counter()
        self._graphs = graphs()
        self._recomputed = recomputations()
        self.recomputed: list[int] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        control = pipeline_control(trainer, RunFacts)
        if control is not None and control.changed_layers(trainer.global_step):
            self.changed.append(len(self.compiled))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._losses.append(outputs["loss"] if isinstance(outputs, dict) else outputs)  # no read in the step
        self._record_grad_norm(trainer)
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        # Data-parallel replicas each consume their own batch; pipeline stages of one replica share one.
        replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        self.tokens += int(inputs.numel()) * int(replicas)
        self.compiled.append(graphs() - self._graphs)
        self._graphs += self.compiled[-1]
        self.recomputed.append(recomputations() - self._recomputed)
        self._recomputed += self.recomputed[-1]
        now = _world(trainer)
        if self.world_sizes and {**self.world_sizes[-1], "step": now["step"]} != now:
            self.world_sizes.append(now)

    def _record_grad_norm(self, trainer: pl.Trainer) -> None:
        """Keep (on the device) the pre-clip global gradient norm of this step, if the pipeline clipped by norm."""
        clipping = getattr(trainer.precision_plugin, "clip_by_norm", None)  # the strategy's precision plugin sets it
        if not isinstance(clipping, GlobalNormClipping):
            return
        norm = clipping.last_norm
        # A new tensor per clipping call: the same one again means no optimizer step clipped since the last batch.
        if norm is not None and norm is not self._last_norm:
            self._grad_norms.append(norm)
            self._last_norm = norm

    @property
    def losses(self) -> list[float]:
        """The training loss of every optimizer step so far."""
        return self._losses.values

    @property
    def grad_norms(self) -> list[float]:
        """The global gradient norm before clipping of every optimizer step so far that clipped by norm."""
        return self._grad_norms.values

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:
            self._t0 = time.perf_counter()

    def _pause(self) -> None:
        if self._t0 is not None:
            self._train_time += time.perf_counter() - self._t0
            self._t0 = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()
        control = pipeline_control(trainer, RunFacts)
        norm = control.param_norm() if control is not None else _param_norm(pl_module)
        replicas_in_sync = control.replicas_in_sync() if control is not None else True
        if not trainer.is_global_zero:
            return
        val = trainer.callback_metrics.get("val_loss")
        summary = {
            "steps": trainer.global_step,
            "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else None,
            "val_loss": float(val) if val is not None else None,
            "tokens_per_s": self.tokens / self._train_time if self._train_time > 0 else None,
            "world_size_start": self.world_size_start,
            "world_size_end": trainer.world_size,
            "world_size": self.world_sizes,
            "replicas_end": _world(trainer)["replicas"],
            "replicas_in_sync": replicas_in_sync,
            "partitions": list(control.partitions) if control is not None else [],
            "releases": list(control.releases) if control is not None else [],
            "param_norm": norm,
            "compiled_graphs_per_step": self.compiled,
            "layers_changed": self.changed,
            "recomputations_per_step": self.recomputed,
            "grad_norms": self.grad_norms,
        }
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)


def _world(trainer: pl.Trainer) -> dict[str, int]:
    """The job's size now: processes and data-parallel replicas of the pipeline."""
    control = pipeline_control(trainer, RunFacts)
    replicas = control.dp_size if control is not None else 1
    return {"step": trainer.global_step, "world_size": trainer.world_size, "replicas": replicas}


def _param_norm(pl_module: pl.LightningModule) -> float:
    """L2 norm (float64) of all parameters of a module that is not split (a pipeline strategy computes its own)."""
    return math.sqrt(sum(float(p.detach().to(torch.float64).square().sum()) for p in pl_module.parameters()))
