"""GradualPruning: Zhu & Gupta's cubic sparsity schedule, structured (real speed-up) or unstructured (masks).

Sparsity follows ``s_t = s_f + (s_0 - s_f) * (1 - (t - t0) / (n * dt)) ** 3`` from ``start_step`` (``t0``) to
``end_step`` (``t0 + n * dt``), applied every ``every_n_steps`` (``dt``) steps, by magnitude.

* ``mode="structured"`` (default) removes whole units: hidden neurons of MLPs and attention heads, physically
  shrinking the weight matrices, so compute falls with the kept fraction on dense kernels. Any submodule of a
  pipeline layer that implements the :class:`PrunableUnits` protocol takes part (the reference GPT's ``MLP`` and
  ``CausalSelfAttention`` do). The optimizer state of the surviving rows/columns is kept (sliced, not reset), and the
  parameter objects stay the same, so optimizers and LR schedulers are untouched. Each kind of unit is pruned to the
  target sparsity of its initial count, globally across all layers (``scope="global"``: layers end up with different
  widths, which is what makes the pipeline uneven) or per module (``scope="layer"``).
* ``mode="unstructured"`` zeroes individual weights of the ``nn.Linear`` layers inside the pipeline layers (the last
  layer excluded), for accuracy experiments. It gives **no speed-up on dense kernels**: the matrices keep their size.
  The mask is the weights' zero pattern: taken before every optimizer step (and applied to the gradients), re-imposed
  after it, so it needs no state of its own and moves and checkpoints with the weights. The global threshold is
  found by bisection with all-reduced counts on the device (:func:`global_magnitude_threshold`): no process sees
  another's weights.

Compiled layers (``torch.compile``) follow the shapes: from setup to teardown of a structured pruning, dynamo treats
parameter shapes as it does other tensors' (automatic dynamic shapes, :func:`_parameter_shapes_static`), so a block
compiles once more when a prune first changes its widths, not once per prune and width.

Shapes live in the layer's parameters, so a pruned layer migrates pruned and a checkpoint resumes pruned (the GPT's
modules take their shapes from the checkpoint before its values). Decisions that span stages (global scores) are
gathered from every process, so all stages prune the same units.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from itertools import accumulate
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Self, override

from dynmo_lightning.core.callback_tools import all_gather, layers_changed, local_layers
from dynmo_lightning.core.control import LayerEditing, layer_editing
from dynmo_lightning.core.parts import held_parts, local_part
from dynmo_lightning.settings import build, configured_by, from_settings

MODES = ("structured", "unstructured")
SCOPES = ("global", "layer")


@runtime_checkable
class PrunableUnits(Protocol):
    """A module whose units (neurons, heads) can be removed: what structured pruning needs from a model."""

    unit_kind: str
    initial_units: int

    def unit_scores(self) -> Tensor:
        """One magnitude score per current unit."""
        ...

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only units ``keep`` (ascending), shrinking parameters and their optimizer state in place."""
        ...


def cubic_sparsity(step: int, initial: float, final: float, start: int, end: int) -> float:
    """Zhu & Gupta's schedule: ``initial`` before ``start``, ``final`` from ``end`` on, cubic in between."""
    if step <= start:
        return initial
    if step >= end:
        return final
    return final + (initial - final) * (1 - (step - start) / (end - start)) ** 3


@dataclasses.dataclass(kw_only=True)
class PruningSettings:
    """:class:`GradualPruning`'s settings (Hydra: ``conf/dynamics/pruning.yaml``)."""

    final_sparsity: float = 0.5
    """Target fraction removed, in [0, 1)."""
    initial_sparsity: float = 0.0
    """Fraction removed at ``start_step``, in [0, ``final_sparsity``]."""
    start_step: int = 20
    """First pruning step."""
    end_step: int = 150
    """Step where the final sparsity is reached (the cubic schedule of Zhu & Gupta in between)."""
    every_n_steps: int = 10
    """Pruning interval."""
    mode: str = "structured"
    """``"structured"`` (whole MLP neurons and attention heads, the matrices shrink) or ``"unstructured"``
    (weights masked to zero; see the module docstring)."""
    scope: str = "global"
    """``"global"`` (rank units or weights across all layers) or ``"layer"`` (each module on its own)."""
    min_units: int = 1
    """Units every structured module keeps at least."""
    multiple_of: int = 1
    """Every structured module keeps a multiple of this many units (rounded up with its next best ones), e.g. 8 for
    widths the matrix units like. Under tensor parallelism also a multiple of ``strategy.tensor_parallel_size`` (the
    least common multiple of both): every process of a stage holds an equal part of a layer's heads and neurons."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.final_sparsity < 1.0:
            raise ValueError(f"dynamics.final_sparsity={self.final_sparsity} must be in [0, 1)")
        if not 0.0 <= self.initial_sparsity <= self.final_sparsity:
            raise ValueError(
                f"dynamics.initial_sparsity={self.initial_sparsity} must be in "
                f"[0, final_sparsity={self.final_sparsity}]"
            )
        if self.end_step <= self.start_step:
            raise ValueError(f"dynamics.end_step={self.end_step} must come after dynamics.start_step={self.start_step}")
        if self.every_n_steps < 1:
            raise ValueError(f"dynamics.every_n_steps={self.every_n_steps} must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"dynamics.mode={self.mode!r} is not one of {list(MODES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"dynamics.scope={self.scope!r} is not one of {list(SCOPES)}")
        if self.min_units < 1:
            raise ValueError(f"dynamics.min_units={self.min_units} must be >= 1")
        if self.multiple_of < 1:
            raise ValueError(f"dynamics.multiple_of={self.multiple_of} must be >= 1")


class GradualPruning(Callback):
    """Prune gradually during training (works with and without ``DynMoStrategy``).

    Set by :class:`PruningSettings`: its fields as keyword arguments, or one settings object through
    :meth:`from_settings`.
    """

    @configured_by(PruningSettings)
    def __init__(self, **kwargs: Any) -> None:
        self.settings = build(PruningSettings, "GradualPruning", "dynamics", kwargs)
        #: Sparsity last applied.
        self.sparsity = 0.0
        self._masks: list[tuple[nn.Parameter, Tensor]] = []
        self._static_shapes: dict[str, bool] | None = None  # dynamo's settings before setup changed them

    @classmethod
    def from_settings(cls, settings: PruningSettings, **overrides: Any) -> Self:
        """The callback of one settings object (``overrides`` replace some of its fields)."""
        return from_settings(cls, PruningSettings, settings, overrides)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.settings.mode == "structured" and self._static_shapes is None:
            self._static_shapes = _parameter_shapes_static(False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._static_shapes is not None:
            _parameter_shapes_static(self._static_shapes)
            self._static_shapes = None

    def sparsity_at(self, step: int) -> float:
        """Target sparsity after ``step`` optimizer steps."""
        s = self.settings
        return cubic_sparsity(step, s.initial_sparsity, s.final_sparsity, s.start_step, s.end_step)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.settings.mode == "unstructured" and self.sparsity > 0:
            self._masks = [(w, w.detach() != 0) for w in _prunable_weights(pl_module)]
            for w, mask in self._masks:
                if w.grad is not None:
                    w.grad.mul_(mask)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        for w, mask in self._masks:  # the optimizer step (momentum, weight decay) may have moved pruned weights
            with torch.no_grad():
                w.mul_(mask)
        self._masks = []
        due = (
            self.settings.start_step <= step <= self.settings.end_step
            and (step - self.settings.start_step) % self.settings.every_n_steps == 0
        )
        target = self.sparsity_at(step)
        if not due or target <= self.sparsity:
            return
        if self.settings.mode == "structured":
            self._prune_units(pl_module, target, trainer.optimizers)
        else:
            self._prune_weights(pl_module, target, trainer.optimizers)
        self.sparsity = target
        pl_module.log("pruning/sparsity", target, on_step=True, on_epoch=False)

    # ----------------------------------------------------------------------------------------------------------------
    def _prune_units(self, pl_module: pl.LightningModule, target: float, optimizers: Sequence[Optimizer]) -> None:
        """Score every prunable module's units, choose the same units everywhere, and remove the rest.

        Under a strategy that holds layers in parts (FSDP2 shards, tensor-parallel parts: :class:`LayerEditing`),
        each layer is read whole to score it, and changed whole (its optimizer state with it), then made parts
        again; every process holding a part of a layer takes part, in layer order.
        """
        editing = layer_editing(pl_module.trainer)
        layers = [(i, layer) for i, layer in local_layers(pl_module) if _prunable(layer)]
        names = {i: [name for name, m in layer.named_modules() if isinstance(m, PrunableUnits)] for i, layer in layers}
        scores = _local_scores(layers, names, editing)
        everyone = {key: value for part in all_gather(scores, pl_module.trainer) for key, value in part.items()}
        multiple = math.lcm(self.settings.multiple_of, 1 if editing is None else editing.unit_multiple)
        keep = self._units_to_keep(everyone, target, multiple)
        for i, _ in layers:
            cut = {name: keep[(i, name)] for name in names[i] if len(keep[(i, name)]) < len(everyone[(i, name)][2])}
            if cut:
                _change(pl_module, i, functools.partial(_keep_units, cut), optimizers, editing)
        # The same set on every process (all scores were gathered): the balancer restarts these layers' costs.
        changed = {key[0] for key, (_, _, scores) in everyone.items() if len(keep[key]) < len(scores)}
        layers_changed(pl_module.trainer, changed)

    def _units_to_keep(
        self, scores: dict[Any, tuple[str, int, list[float]]], target: float, multiple: int = 1
    ) -> dict[Any, Tensor]:
        """Ascending indices of the units each module keeps; the same result on every process.

        ``multiple``: every module keeps a multiple of it (the tensor-parallel size), rounded up with its next best
        units; ``min_units`` is rounded up likewise.
        """
        least = _round_up(self.settings.min_units, multiple)
        if self.settings.scope == "layer":
            return {key: torch.tensor(_top(s, min(len(s), _round_up(max(least, math.ceil((1 - target) * initial)),
                                                                    multiple))), dtype=torch.long)
                    for key, (_, initial, s) in scores.items()}  # fmt: skip
        keep: dict[Any, Tensor] = {}
        for kind in sorted({kind for kind, _, _ in scores.values()}):
            keys = sorted(k for k, v in scores.items() if v[0] == kind)
            total = sum(scores[k][1] for k in keys)
            budget = max(len(keys) * least, math.ceil((1 - target) * total))
            # Every module keeps its min_units best units; the rest of the budget goes to the best scores anywhere.
            # Ties break by (module, unit) order, so every process picks the same units.
            chosen = {k: set(_top(scores[k][2], min(least, len(scores[k][2])))) for k in keys}
            rest = sorted(
                ((-v, n, j) for n, k in enumerate(keys) for j, v in enumerate(scores[k][2]) if j not in chosen[k])
            )
            for _, n, j in rest[: max(0, budget - sum(len(c) for c in chosen.values()))]:
                chosen[keys[n]].add(j)
            for k in keys:
                keep[k] = torch.tensor(sorted(_rounded_up(chosen[k], scores[k][2], multiple)), dtype=torch.long)
        return keep

    def _prune_weights(self, pl_module: pl.LightningModule, target: float, optimizers: Sequence[Optimizer]) -> None:
        weights = _prunable_weights(pl_module)
        thresholds: list[Tensor | float]
        if self.settings.scope == "global":
            parts = [local_part(w) for w in weights]
            threshold = global_magnitude_threshold(parts, target, pl_module.device, [held_parts(w) for w in weights])
            thresholds = [threshold] * len(weights)
        else:
            thresholds = []
            for w in weights:
                k = int(target * w.numel())
                thresholds.append(float(w.detach().abs().flatten().kthvalue(k).values) if k > 0 else -1.0)
        for w, threshold in zip(weights, thresholds, strict=True):
            local = local_part(w)  # a shard's mask is the shard of the mask: element-wise, no collective
            mask = local.detach().abs() > threshold
            with torch.no_grad():
                local.mul_(mask)
            for opt in optimizers:
                for value in opt.state.get(w, {}).values():
                    if isinstance(value, Tensor) and value.shape == w.shape:
                        local_part(value).mul_(mask)

    # ----------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"sparsity": self.sparsity}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sparsity = float(state_dict["sparsity"])


def global_magnitude_threshold(
    parts: Sequence[Tensor], fraction: float, device: torch.device, weights: Sequence[int] | None = None
) -> Tensor:
    """The ``k``-th smallest magnitude over every process's ``parts`` (``k``: ``fraction`` of their elements).

    What ``kthvalue`` of all magnitudes gathered in one place gives (``-1`` when ``k`` is 0), found without moving
    them: a bisection over the float32 bit patterns of the magnitudes (non-negative floats order as their bits), 31
    rounds of counting the elements at or below the midpoint, summed over all processes by an all-reduce of one
    number on ``device``. Nothing is read on the host. Each process passes the part of the weights it holds (a
    shard under FSDP2, a tensor-parallel split, whole copies under DDP replicas), each counted ``weights`` times
    (:func:`~dynmo_lightning.protocol.held_parts`, so that every element counts as often as every other, the same
    fraction).

    Args:
        parts: this process's tensors (the local parts of its weights).
        fraction: share of all elements at or below the threshold.
        device: where the counts are reduced (the weights' device; used when this process holds no weights).
        weights: how many times each part counts (default: once).
    """
    times = list(weights) if weights is not None else [1] * len(parts)
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()

    def total(x: Tensor, op: Any = None) -> Tensor:
        if distributed:
            dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
        return x

    def at_most(bound: Tensor) -> Tensor:
        count = torch.zeros((), dtype=torch.int64, device=device)
        for part, w in zip(parts, times, strict=True):  # one part's float magnitudes at a time: no copy of them all
            count += (part.detach().abs().float() <= bound).sum() * w
        return total(count)

    n = total(torch.full((), sum(p.numel() * w for p, w in zip(parts, times, strict=True)), dtype=torch.int64,
                         device=device))  # fmt: skip
    top = torch.zeros((), dtype=torch.int64, device=device)
    for part in parts:
        if part.numel():
            top = torch.maximum(top, part.detach().abs().float().max().view(torch.int32).to(torch.int64))
    hi = total(top, dist.ReduceOp.MAX if distributed else None).clamp(max=_INF_BITS)
    k = (n.double() * fraction).floor().to(torch.int64)
    lo = torch.zeros_like(hi)
    for _ in range(31):  # the bit patterns of non-negative float32 values are below 2**31
        mid = (lo + hi) // 2
        enough = at_most(mid.to(torch.int32).view(torch.float32)) >= k
        hi, lo = torch.where(enough, mid, hi), torch.where(enough, lo, mid + 1)
    return torch.where(k > 0, hi.to(torch.int32).view(torch.float32), -1.0)


#: The bit pattern of float32 infinity: the largest magnitude counted (NaN patterns lie above it).
_INF_BITS = 0x7F800000


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rounded_up(chosen: set[int], scores: Sequence[float], multiple: int) -> set[int]:
    """``chosen`` units with the next best ones added until their count is a multiple of ``multiple`` (or all)."""
    more = _round_up(len(chosen), multiple) - len(chosen)
    best = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return chosen | set([j for j in best if j not in chosen][:more])


def _local_scores(
    layers: Sequence[tuple[int, nn.Module]], names: dict[int, list[str]], editing: LayerEditing | None
) -> dict[tuple[int, str], tuple[str, int, list[float]]]:
    """``{(layer, module): (unit kind, initial units, scores)}`` of this process's prunable modules.

    Each layer is read whole (``editing``: a copy if held in parts); all scores come to the host in one read (one
    device synchronisation per pruning step).
    """
    local: list[Tensor] = []
    info: dict[tuple[int, str], tuple[str, int]] = {}
    for i, layer in layers:
        with nullcontext(layer) if editing is None else editing.whole_layer(i) as held:
            for name in names[i]:
                m = held.get_submodule(name)
                local.append(m.unit_scores().detach().float().flatten())  # new tensors: not the copy's
                info[(i, name)] = (m.unit_kind, m.initial_units)
    flat = torch.cat(local).tolist() if local else []
    bounds = list(accumulate((len(t) for t in local), initial=0))
    return {key: (*info[key], flat[bounds[n] : bounds[n + 1]]) for n, key in enumerate(info)}


def _change(
    pl_module: pl.LightningModule,
    index: int,
    change: Callable[[nn.Module, Sequence[Any]], None],
    optimizers: Sequence[Optimizer],
    editing: LayerEditing | None,
) -> None:
    """Apply ``change`` to local layer ``index``: where it is, or whole through the strategy's ``editing`` role."""
    if editing is None:
        change(pl_module.pipeline_layers()[index], optimizers)
    else:
        editing.reshape_layer(index, change)


def _keep_units(cut: dict[str, Tensor], layer: nn.Module, optimizers: Sequence[Any]) -> None:
    """Keep units ``cut[name]`` of every module ``name`` of ``layer`` (its optimizer state with it)."""
    for name, kept in cut.items():
        m = layer.get_submodule(name)
        m.keep_units(kept.to(next(m.parameters()).device), optimizers)


def _prunable(layer: nn.Module) -> bool:
    return any(isinstance(m, PrunableUnits) for m in layer.modules())


def _top(scores: Sequence[float], k: int) -> list[int]:
    """Ascending indices of the ``k`` largest scores (ties to the lower index)."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(order[:k])


#: Dynamo's settings that keep the shapes of parameters and of built-in modules' tensors (``nn.Linear``'s) static.
_STATIC_SHAPES = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes")


def _parameter_shapes_static(static: bool | dict[str, bool]) -> dict[str, bool]:
    """Set dynamo's :data:`_STATIC_SHAPES` (a dict: each to its value); returns what they were.

    By default ``torch.compile`` takes every parameter's shape as fixed, so a layer compiled before a prune compiles
    again for each width it is pruned to: one graph per prune and block, until dynamo's recompile limit (8 graphs
    of ``Block.forward``) makes every block eager. Not static, they are like other tensors' (automatic dynamic
    shapes): a dimension keeps its size in the graph until a prune changes it, then one graph with that size
    dynamic serves every later width (sizes 0 and 1 apart, which dynamo specialises).
    """
    config = torch._dynamo.config
    before = {name: getattr(config, name) for name in _STATIC_SHAPES if hasattr(config, name)}
    for name in before:
        setattr(config, name, static[name] if isinstance(static, dict) else static)
    return before


def _prunable_weights(pl_module: pl.LightningModule) -> list[nn.Parameter]:
    """Weights of the matmul modules in the local pipeline layers, the last (output) layer excluded.

    Matmul modules are ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2's projections, a transposed linear); the
    latter can only be in the model when ``transformers`` was imported, so it is looked up there, not imported.
    """
    kinds: tuple[type, ...] = (nn.Linear,)
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None:
        kinds += (conv1d,)
    n_layers = len(pl_module.pipeline_layers())
    return [
        m.weight
        for i, layer in local_layers(pl_module)
        if i < n_layers - 1
        for m in layer.modules()
        if isinstance(m, kinds)
    ]
