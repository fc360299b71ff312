"""What each dynamic does to each layer during a real training run, and what that costs at LLM size.

:func:`record` trains the reference GPT (deep and narrow, on one process) with one dynamic technique configured as
its own paper runs it (:data:`PRESETS`, with a strength knob) and records every layer's *state* at every step: frozen
or not, the kept share of MLP neurons and attention heads, the share of tokens still active (early exit), the routed
capacity (Mixture of Depths), the attention density, and every expert's share of the tokens (Mixture of Experts),
with the validation loss at the end. The run is small, but the states are what the technique really did.

:func:`realistic_trace` turns a timeline into a cost trace at LLM size: each layer's forward and backward time in its
state at each step (and the weight-gradient part of the backward, which zero-bubble schedules run apart), looked up
in the layer costs measured on this machine (:class:`~.layer_costs.CostTable`), with the parameter, optimizer-state
and activation bytes of the large layer. Steps where a layer's structure changed (frozen, pruned) carry them as
``changed_layers``: the balancer's events.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch

from dynmo_lightning.bench.layer_costs import CostTable, LayerCost
from dynmo_lightning.callbacks import (
    DynamicSparseAttention,
    GradualPruning,
    LayerFreezing,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)
from dynmo_lightning.core.host_values import DeviceScalars
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.models.blocks import MLP, CausalSelfAttention
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.models.routing import DepthRouter, ExitGate
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention


@dataclasses.dataclass(frozen=True)
class Preset:
    """A dynamic configured as its paper runs it: the callback for a strength, the preset strength and a sweep.

    Attributes:
        name: what the preset follows.
        strength: what the knob means.
        preset: the strength of the named preset.
        sweep: strengths of the sweep (the preset among them).
        make: ``make(strength, steps, n_blocks)`` returns the callback for a run of ``steps`` steps.
    """

    name: str
    strength: str
    preset: float
    sweep: tuple[float, ...]
    make: Callable[[float, int, int], L.Callback]


def _freezing(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # AutoFreeze: every window, freeze the prefix of layers in front of the first one whose gradient-norm change
    # reaches the strength's percentile of the trainable layers' changes (a higher percentile freezes more).
    window = max(5, steps // 15)
    return LayerFreezing(
        mode="auto", check_every_n_steps=window, start_step=steps // 5, percentile=strength, max_frozen_fraction=0.9
    )


def _pruning(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # Zhu & Gupta's cubic schedule to the final sparsity, units ranked across all layers (global magnitude).
    return GradualPruning(
        final_sparsity=strength, start_step=steps // 6, end_step=2 * steps // 3, every_n_steps=max(1, steps // 30)
    )


def _early_exit(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # Hidden-state saturation (cos(in, out) >= 0.9) allowed after a minimum depth, the strength's share of the blocks.
    # The depth is the knob: in this deep residual stream a block changes a token's direction so little that every
    # threshold from 0.8 to 0.999 lets nearly all tokens leave at the first block allowed.
    return TokenEarlyExit(
        threshold=0.9, warmup_steps=steps // 5, ramp_steps=steps // 5, min_layers=max(1, round(strength * n_blocks))
    )


def _mod(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # Raposo et al.: every other block routes the top capacity share of each sequence, annealed from dense.
    return MixtureOfDepths(capacity=strength, every=2, start_step=steps // 10, anneal_steps=steps // 3)


def _moe(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # Switch Transformer: top-1 routing to 8 experts in every other block, tokens over capacity dropped.
    return MixtureOfExperts(n_experts=8, every=2, top_k=1, capacity_factor=strength)


def _sparse(strength: float, steps: int, n_blocks: int) -> L.Callback:
    # Block-sparse attention whose density each layer steers toward a share of the attention mass.
    return DynamicSparseAttention(attn_block=8, density=1.0, target_coverage=strength)


#: The dynamics as their own papers run them (the preset strength is the named configuration).
PRESETS: dict[str, Preset] = {
    "freezing": Preset(
        "AutoFreeze (growing frozen prefix)", "percentile", 60.0, (40.0, 60.0, 80.0, 95.0, 99.0), _freezing
    ),
    "pruning": Preset(
        "Zhu & Gupta, global structured", "final sparsity", 0.8, (0.3, 0.5, 0.7, 0.8, 0.9, 0.95), _pruning
    ),
    "early_exit": Preset(
        "saturation exits (cos 0.9)", "minimum depth share", 0.25, (0.75, 0.5, 0.25, 0.125, 0.0), _early_exit
    ),
    "mod": Preset("Mixture of Depths, every other block", "capacity", 0.125, (0.5, 0.25, 0.125, 0.0625, 0.03125), _mod),
    "moe": Preset("Switch, 8 experts every other block", "capacity factor", 1.25, (2.0, 1.25, 1.0, 0.75, 0.5), _moe),
    "sparse_attention": Preset("adaptive block-sparse", "target coverage", 0.9, (0.95, 0.9, 0.8, 0.6, 0.4), _sparse),
}


class LayerStates(L.Callback):
    """Records every pipeline layer's dynamic state at every training step (single-process runs)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._exited: dict[int, int] = {}
        self._hooked: set[int] = set()

    def _count_exits(self, i: int) -> Callable[..., None]:
        # Counted here, from each gate's input and output mask: the gates' own counters belong to the early-exit
        # callback, which resets them when it logs.
        def hook(gate: ExitGate, inputs: tuple[Any, ...], active: torch.Tensor) -> None:
            if gate.training:
                self._exited[i] = self._exited.get(i, 0) + int(((inputs[2] > 0) & (active == 0)).sum())

        return hook

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """The structure the step runs with (after the dynamics changed it at the end of the last step)."""
        layers = pl_module.pipeline_layers()
        state: dict[str, Any] = {"frozen": [bool(getattr(layer, "pipeline_frozen", False)) for layer in layers]}
        state["mlp_kept"] = [_kept(getattr(layer, "mlp", None), MLP) for layer in layers]
        state["heads_kept"] = [_kept(getattr(layer, "attn", None), CausalSelfAttention) for layer in layers]
        state["capacity"] = [_first(layer, DepthRouter, lambda m: float(m.capacity)) for layer in layers]
        state["density"] = [_first(layer, SparseCausalSelfAttention, lambda m: float(m.density)) for layer in layers]
        self.steps.append(state)
        for i, gate in _gates(layers):
            if id(gate) not in self._hooked:
                self._hooked.add(id(gate))
                gate.register_forward_hook(self._count_exits(i))
        self._exited = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """What the step measured: active tokens entering each block, the experts' shares of the tokens."""
        layers, state = pl_module.pipeline_layers(), self.steps[-1]
        tokens = batch[0].numel()
        active, gone = [], 0
        for i in range(len(layers)):
            active.append(1.0 - gone / tokens)
            gone += self._exited.get(i, 0)
        state["active"] = active
        state["experts"] = [_first(layer, MoEMLP, _expert_shares) for layer in layers]


def _gates(layers: list[torch.nn.Module]) -> list[tuple[int, ExitGate]]:
    return [(i, m) for i, layer in enumerate(layers) for m in layer.modules() if isinstance(m, ExitGate)]


def _first(layer: torch.nn.Module, kind: type, read: Callable[[Any], Any]) -> Any:
    return next((read(m) for m in layer.modules() if isinstance(m, kind)), None)


def _kept(part: Any, kind: type) -> float | None:
    """The kept share of a block's prunable MLP or attention (``None`` for other layers and MoE MLPs)."""
    if not isinstance(part, kind):
        return None
    units = part.fc.out_features if isinstance(part, MLP) else part.n_head
    return round(units / part.initial_units, 4)


def _expert_shares(moe: MoEMLP) -> list[float]:
    """Every expert's kept tokens as a share of the tokens routed in the step (times ``top_k``)."""
    kept = moe.tokens_per_expert
    assigned = sum(kept) / (1.0 - moe.drop_fraction) if moe.drop_fraction < 1.0 else 0.0
    return [round(n / assigned, 4) if assigned else 0.0 for n in kept]


@dataclasses.dataclass(frozen=True)
class TimelineConfig:
    """The run a timeline is recorded from (a deep, narrow GPT on the standard-library corpus).

    Attributes:
        n_blocks: transformer blocks (the pipeline has two more layers: embedding and head).
        n_embd: hidden size.
        n_head: attention heads.
        seq: tokens per sequence.
        batch: sequences per batch.
        steps: training steps.
        lr: peak learning rate.
        seed: seed of the data order and the initialisation.
    """

    n_blocks: int = 62
    n_embd: int = 64
    n_head: int = 4
    seq: int = 64
    batch: int = 8
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0


def record(dynamic: str, strength: float | None, config: TimelineConfig = TimelineConfig()) -> dict[str, Any]:
    """Train with ``dynamic`` at ``strength`` (``"none"``: no dynamic) and return the layer-state timeline.

    Returns:
        ``{"dynamic", "strength", "config", "states": [per step {field: per-layer list}], "train_loss",
        "val_loss"}``.
    """
    L.seed_everything(config.seed)
    model = GPT(
        n_layer=config.n_blocks,
        n_embd=config.n_embd,
        n_head=config.n_head,
        block_size=config.seq,
        lr=config.lr,
        warmup_steps=config.steps // 10,
        init_seed=config.seed,
        tie_embeddings=False,
    )
    states, losses = LayerStates(), Losses()
    callbacks: list[L.Callback] = [states, losses]
    if dynamic != "none":
        assert strength is not None
        callbacks.insert(0, PRESETS[dynamic].make(strength, config.steps, config.n_blocks))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=config.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=config.steps,
        limit_val_batches=16,
        num_sanity_val_steps=0,
    )
    data = StdlibCharDataModule(block_size=config.seq, batch_size=config.batch, max_bytes=2_000_000, seed=config.seed)
    trainer.fit(model, datamodule=data)
    return {
        "dynamic": dynamic,
        "strength": strength,
        "config": dataclasses.asdict(config),
        "states": states.steps,
        "train_loss": losses.values,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


class Losses(L.Callback):
    """The training loss of every step (kept on the device until :attr:`values` is read)."""

    def __init__(self) -> None:
        self._losses = DeviceScalars()

    @property
    def values(self) -> list[float]:
        """The losses so far, as floats."""
        return self._losses.values

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, b: Any, i: int):
        """Record the step's loss."""
        self._losses.append(outputs["loss"] if isinstance(outputs, dict) else outputs)


def realistic_trace(timeline: dict[str, Any], table: CostTable) -> list[dict[str, Any]]:
    """The cost trace of the timeline's run at the size of the measured layers (see the module docstring)."""
    shape, steps = table.shape, []
    previous: dict[str, Any] | None = None
    for k, state in enumerate(timeline["states"]):
        n = len(state["frozen"])
        fwd, bwd, wgt, params = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        for i in range(n):
            (fwd[i], bwd[i], wgt[i]), params[i] = _layer_cost(table, state, i, n)
        frozen = state["frozen"]
        optim = [0.0 if frozen[i] else 2 * p for i, p in enumerate(params)]  # Adam's two moments
        act = float(shape.tokens * shape.hidden * 2)  # bf16 hidden states between stages
        entry = {
            "step": k,
            "fwd": fwd,
            "bwd": bwd,
            "bwd_weight": wgt,
            "param_bytes": [4 * p for p in params],
            "optim_bytes": [4 * p for p in optim],
            "activation_bytes": [act] * n,
            "changed_layers": _changed(previous, state),
        }
        steps.append(entry)
        previous = state
    return steps


def _layer_cost(table: CostTable, state: dict[str, Any], i: int, n: int) -> tuple[LayerCost, float]:
    """The cost (forward, backward, its weight part) and the parameter count of layer ``i`` of ``n`` in ``state``."""
    shape = table.shape
    if i == 0:
        cost, params = table.end("embedding"), float((shape.vocab + shape.seq) * shape.hidden)
    elif i == n - 1:
        cost, params = table.end("head"), float(shape.vocab * shape.hidden + 2 * shape.hidden)
    else:
        cost, params = _block_cost(table, state, i)
    # a frozen layer has no backward (the freezing dynamics freeze a prefix: no input gradient either); the head
    # and its loss always run backward, as the traces before the weight split priced it
    frozen = state["frozen"][i] and i < n - 1
    return (LayerCost(cost.fwd, 0.0, 0.0) if frozen else cost), params


def _block_cost(table: CostTable, state: dict[str, Any], i: int) -> tuple[LayerCost, float]:
    shape = table.shape
    frozen, mlp, heads = state["frozen"][i], state["mlp_kept"][i], state["heads_kept"][i]
    experts, capacity, density = state["experts"][i], state["capacity"][i], state["density"][i]
    if experts is not None:
        return table.moe([share * shape.tokens for share in experts]), float(shape.moe_params())
    if capacity is not None and capacity < 1.0:
        return table.mod(capacity), float(shape.block_params())
    if density is not None and density < 1.0:
        return table.sparse(_kept_blocks(density, shape.seq // shape.attn_block)), float(shape.block_params())
    if state["active"][i] < 1.0:
        return table.exit(state["active"][i]), float(shape.block_params())
    m, h = (1.0 if mlp is None else mlp), (1.0 if heads is None else heads)
    return table.block(frozen=frozen, mlp_kept=m, heads_kept=h), float(shape.block_params(m, h))


def _kept_blocks(density: float, n_blocks: int) -> float:
    """Share of the causal key blocks a sparse attention at ``density`` computes (its own rule, at this length)."""
    kept = [max(1, min(i + 1, math.floor(density * (i + 1) + 0.5))) for i in range(n_blocks)]
    return sum(kept) / (n_blocks * (n_blocks + 1) / 2)


def _changed(previous: dict[str, Any] | None, state: dict[str, Any]) -> list[int]:
    """Layers whose structure changed since the last step (frozen, pruned): the balancer's events."""
    if previous is None:
        return []
    fields = ("frozen", "mlp_kept", "heads_kept")
    return [i for i in range(len(state["frozen"])) if any(previous[f][i] != state[f][i] for f in fields)]
