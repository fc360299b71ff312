"""The model summary of a split model: the whole model's totals and one row per pipeline stage.

Under a pipeline strategy each process holds its stage's layers only, so Lightning's ``ModelSummary`` (printed at
fit start by global rank 0) would describe rank 0's stage as the model. :class:`PipelineModelSummary` and
:class:`PipelineRichModelSummary` print the unsplit model's parameter counts and size, with a row per stage
(stage, pipeline rank, layers, parameters, trainable ones, device). ``DynMoStrategy`` puts them in place of
Lightning's own ``ModelSummary`` / ``RichModelSummary`` at set-up (:func:`use_pipeline_summaries`; the default one
of ``enable_model_summary`` included), keeping their ``max_depth`` and arguments. Everything is counted when the
summary is made (:func:`pipeline_summary`, collective), so one made after a migration or a repack shows the split
in force, and structured pruning's smaller layers are counted as they are.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from torch import nn
from typing_extensions import override

from dynmo_lightning.core.callback_tools import all_gather, local_layers
from dynmo_lightning.core.control import RunFacts, pipeline_control


@dataclasses.dataclass(frozen=True)
class StageRow:
    """One pipeline stage in the summary.

    Attributes:
        stage: the (virtual) stage's index.
        rank: the pipeline rank that runs it.
        layers: indices of its pipeline layers.
        params: parameters the stage holds (a parameter tied to another stage's layer counts on both).
        trainable: those of them that require gradients.
        device: where the stage runs (the first replica's process, with data parallelism).
    """

    stage: int
    rank: int
    layers: range
    params: int
    trainable: int
    device: str


@dataclasses.dataclass(frozen=True)
class PipelineSummary:
    """The whole model as Lightning's summary reports it, and its stages.

    Attributes:
        stages: one row per stage, in pipeline order.
        total_parameters: parameters of the unsplit model (each tied parameter once).
        trainable_parameters: those of them that require gradients.
        model_size: megabytes of those parameters (their own element sizes).
        training_modes: ``{"train": n, "eval": n}``, the unsplit model's submodules in each mode.
    """

    stages: list[StageRow]
    total_parameters: int
    trainable_parameters: int
    model_size: float
    training_modes: dict[str, int]

    def columns(self) -> list[tuple[str, list[str]]]:
        """The stage table as Lightning's summaries take it: ``(header, values)`` per column."""
        rows = self.stages
        return [
            ("Stage", [str(r.stage) for r in rows]),
            ("Rank", [str(r.rank) for r in rows]),
            ("Layers", [_span(r.layers) for r in rows]),
            ("Params", [get_human_readable_count(r.params) for r in rows]),
            ("Trainable", [get_human_readable_count(r.trainable) for r in rows]),
            ("Device", [r.device for r in rows]),
        ]


@dataclasses.dataclass(frozen=True)
class _LayerCount:
    """What one process knows of one of its layers; ``owned_*`` count each tied parameter in its first layer only."""

    params: int
    trainable: int
    owned: int
    owned_trainable: int
    owned_bytes: int
    modes: tuple[int, int]


def pipeline_summary(trainer: pl.Trainer, pl_module: pl.LightningModule) -> PipelineSummary:
    """The whole model's summary under a pipeline strategy (collective: call it on every process).

    Each process counts its own layers; one gather over the strategy's CPU group brings the counts together.

    Raises:
        TypeError: the trainer's strategy does not split the model.
    """
    control = pipeline_control(trainer, RunFacts)
    if control is None:
        raise TypeError("pipeline_summary needs a pipeline strategy (DynMoStrategy); use Lightning's ModelSummary")
    parts = all_gather(_local_counts(control, trainer, pl_module), trainer)  # the first replica's, by pipeline rank
    counts = {i: c for part in parts for i, c in part["layers"].items()}
    rank_of = {i: rank for rank, part in enumerate(parts) for i in part["layers"]}
    rows = []
    ends = list(itertools.accumulate(control.layers_per_stage))
    for stage, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):  # the last end starts no stage
        layers = range(start, end)
        rank = rank_of[start]
        params, trainable = (sum(getattr(counts[i], f) for i in layers) for f in ("params", "trainable"))
        rows.append(StageRow(stage, rank, layers, params, trainable, parts[rank]["device"]))
    train, evaluating = parts[0]["outside"]  # modules outside the layers are on every process
    for c in counts.values():
        train, evaluating = train + c.modes[0], evaluating + c.modes[1]
    return PipelineSummary(
        rows,
        sum(c.owned for c in counts.values()),
        sum(c.owned_trainable for c in counts.values()),
        sum(c.owned_bytes for c in counts.values()) * 1e-6,
        {"train": train, "eval": evaluating},
    )


def _local_counts(control: RunFacts, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """This process's layers' counts, its device, and the train/eval modes of the modules outside every layer."""
    layers: dict[int, _LayerCount] = {}
    seen: set[int] = set()  # a parameter shared by two local layers is owned once
    inside: set[int] = set()
    for i, layer in local_layers(pl_module):
        params = trainable = owned = owned_trainable = owned_bytes = 0
        for p in layer.parameters():
            n = p.numel()  # a DTensor's global count: the layer's, whatever part of it this process holds
            params += n
            trainable += n if p.requires_grad else 0
            if id(p) not in seen and min(control.tie_layers(p) | {i}) == i:
                owned += n
                owned_trainable += n if p.requires_grad else 0
                owned_bytes += n * p.element_size()
            seen.add(id(p))
        modules = list(layer.modules())
        inside.update(id(m) for m in modules)
        layers[i] = _LayerCount(params, trainable, owned, owned_trainable, owned_bytes, _modes(modules))
    outside = [m for m in pl_module.modules() if m is not pl_module and id(m) not in inside and not _remote(m)]
    return {
        "layers": layers,
        "device": str(trainer.strategy.root_device),
        "outside": _modes(outside),
    }


def _modes(modules: list[nn.Module]) -> tuple[int, int]:
    """How many of ``modules`` are in train mode, and how many in eval mode."""
    training = sum(m.training for m in modules)
    return training, len(modules) - training


def _remote(module: nn.Module) -> bool:
    """Whether ``module`` stands in for another stage's layer (counted by the stage that holds it)."""
    return bool(getattr(module, "pipeline_remote", False))


def _span(layers: range) -> str:
    """``"3"`` for one layer, ``"0-3 (4)"`` for several."""
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers.stop - 1} ({len(layers)})"


class PipelineModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` for a split model: the whole model's totals and a row per stage.

    Under a strategy that does not split the model it is Lightning's own. ``max_depth=0`` turns it off; any other
    depth gives the stage table (a stage's modules are on another process than global rank 0).
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pipeline_control(trainer, RunFacts) is None:
            super().on_fit_start(trainer, pl_module)
        elif self._max_depth:
            summary = pipeline_summary(trainer, pl_module)  # every process counts its own layers
            if trainer.is_global_zero:
                self.summarize_pipeline(summary, **self._summarize_kwargs)

    @staticmethod
    def summarize_pipeline(summary: PipelineSummary, **summarize_kwargs: Any) -> None:
        """Print ``summary`` (global rank 0 calls it) as Lightning's plain table does, through its logger."""
        totals = (summary.total_parameters, summary.trainable_parameters, summary.model_size, summary.training_modes)
        # FLOPs 0, as Lightning's without an example input: a forward cannot run on one stage.
        ModelSummary.summarize(summary.columns(), *totals, 0, **summarize_kwargs)


class PipelineRichModelSummary(PipelineModelSummary, RichModelSummary):
    """Lightning's ``RichModelSummary`` for a split model (see :class:`PipelineModelSummary`)."""

    @staticmethod
    @override
    def summarize_pipeline(summary: PipelineSummary, **summarize_kwargs: Any) -> None:
        """Print ``summary`` as Lightning's rich table and totals (``header_style`` as ``RichModelSummary``)."""
        from rich import get_console
        from rich.table import Table

        console = get_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        columns = summary.columns()
        for name, _ in columns:
            table.add_column(name, justify="right" if name in ("Params", "Trainable") else "left")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        frozen = summary.total_parameters - summary.trainable_parameters
        for name, value in (
            ("Trainable params", get_human_readable_count(summary.trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(frozen)),
            ("Total params", get_human_readable_count(summary.total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(summary.model_size)),
            ("Modules in train mode", summary.training_modes["train"]),
            ("Modules in eval mode", summary.training_modes["eval"]),
            ("Total FLOPs", 0),
        ):
            grid.add_row(f"[bold]{name}[/]: {value}")
        console.print(grid)


#: Lightning's summaries and what replaces each under a pipeline strategy.
_PIPELINE_KINDS: dict[type[Callback], type[PipelineModelSummary]] = {
    ModelSummary: PipelineModelSummary,
    RichModelSummary: PipelineRichModelSummary,
}


def use_pipeline_summaries(callbacks: list[Callback]) -> None:
    """Replace Lightning's own ``ModelSummary`` and ``RichModelSummary`` in ``callbacks`` by the pipeline ones.

    Their settings carry over; subclasses (a user's own summary) are left as they are.
    """
    for k, callback in enumerate(callbacks):
        if (kind := _PIPELINE_KINDS.get(type(callback))) is not None:
            callbacks[k] = kind(callback._max_depth, **callback._summarize_kwargs)
