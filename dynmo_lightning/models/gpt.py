"""A readable decoder-only GPT that implements the pipeline protocol.

The model is a chain of self-contained layers: ``Embedding`` (token + position), ``n_layer`` transformer ``Block`` s and
a ``Head`` (final norm + vocabulary projection). ``pipeline_layers()`` returns exactly that chain, so any contiguous
run of layers is a valid pipeline stage and rebalancing can move any block anywhere.

Layers are created in ``configure_model`` so that a pipeline strategy can create them on the meta device and
materialise each one only on the stage that owns it. Every layer is initialised from its own seed
(:func:`~dynmo_lightning.protocol.layer_seed`), so layer ``i`` has the same weights whichever process builds it and
whether or not the model is split.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.core.layer_init import init_layer
from dynmo_lightning.core.model import PipelineModule
from dynmo_lightning.models.blocks import MLP, Block, CausalSelfAttention, Embedding, Head
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention, adapt_densities

# The parts live in blocks.py; importing them from here keeps working.
__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "Embedding", "Head"]


class GPT(PipelineModule):
    """Decoder-only GPT for next-token prediction, ready for pipeline parallelism.

    Args:
        vocab_size: number of token ids.
        block_size: maximum (and training) sequence length.
        n_layer: number of transformer blocks; the pipeline sees ``n_layer + 2`` layers (embedding, blocks, head).
        n_head: attention heads per block.
        n_embd: hidden size.
        mlp_ratio: MLP hidden size as a multiple of ``n_embd``; a list gives each block its own (an uneven model
            whose blocks cost very different amounts, as after structured pruning).
        dropout: dropout probability (0 keeps pipeline runs bit-comparable to single-process runs).
        bias: whether linear layers and norms have biases.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay of weight matrices (biases, norms and embeddings are not decayed).
        betas: AdamW betas.
        warmup_steps: linear learning-rate warm-up steps (0 disables the schedule).
        lr_decay_steps: cosine decay length after warm-up; ``None`` keeps the peak rate after warm-up.
        min_lr_ratio: the floor of the cosine decay as a fraction of ``lr``.
        init_seed: base seed of the per-layer initialisation.
        early_exit: give every block an exit gate (token early exit; the ``TokenEarlyExit`` callback sets the
            thresholds). Activations then carry the active-token mask.
        mod_every: Mixture of Depths on every ``mod_every``-th block (0: off).
        mod_capacity: fraction of tokens a routed block processes (the ``MixtureOfDepths`` callback schedules it).
        n_experts: experts of the Mixture-of-Experts MLP (1: dense MLPs).
        moe_every: which blocks get the MoE MLP (every ``moe_every``-th).
        moe_top_k: experts per token (1 = Switch, 2 = GShard).
        moe_capacity_factor: expert capacity factor (``None``: dropless).
        moe_aux_coef: weight of the load-balancing loss.
        moe_z_coef: weight of the router z-loss.
        attention: ``"dense"`` or ``"sparse"`` (dynamic block-sparse causal attention).
        attn_block: block size of sparse attention (must divide the sequence length).
        attn_density: initial fraction of key blocks each query block keeps (1: dense).
        attn_target_coverage: adapt each layer's density toward this attention-mass coverage (``None``: fixed).
        tie_embeddings: share the token embedding with the output projection (as GPT-2); under a pipeline the
            first and last stages each hold a copy, kept identical (see :mod:`dynmo_lightning.pipeline.stage.ties`).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        mlp_ratio: int | list[int] = 4,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        init_seed: int = 0,
        early_exit: bool = False,
        mod_every: int = 0,
        mod_capacity: float = 0.125,
        n_experts: int = 1,
        moe_every: int = 2,
        moe_top_k: int = 1,
        moe_capacity_factor: float | None = 1.25,
        moe_aux_coef: float = 0.01,
        moe_z_coef: float = 1e-3,
        attention: str = "dense",
        attn_block: int = 64,
        attn_density: float = 1.0,
        attn_target_coverage: float | None = None,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._check_hparams()
        self.pipeline_init_seed = init_seed
        self.embed: Embedding | None = None
        self.blocks: nn.ModuleList | None = None
        self.head: Head | None = None

    def configure_model(self) -> None:
        """Create the layers (on the meta device under a pipeline strategy, else initialised right here)."""
        if self.blocks is not None:
            return
        hp = self.hparams
        self.embed = Embedding(hp.vocab_size, hp.block_size, hp.n_embd, hp.dropout, carry=self.carries_state)
        ratios = hp.mlp_ratio if isinstance(hp.mlp_ratio, (list, tuple)) else [hp.mlp_ratio] * hp.n_layer
        self.blocks = nn.ModuleList(self._block(i, r * hp.n_embd) for i, r in enumerate(ratios))
        self.head = Head(hp.n_embd, hp.vocab_size, hp.bias)
        if hp.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        for i, layer in enumerate(self.pipeline_layers()):
            if not any(p.is_meta for p in layer.parameters()):
                init_layer(self, i, layer, self.pipeline_init_seed)

    def _check_hparams(self) -> None:
        hp = self.hparams
        if hp.n_layer < 1:
            raise ValueError(f"model.n_layer={hp.n_layer}: a GPT needs at least one block")
        if isinstance(hp.mlp_ratio, (list, tuple)) and len(hp.mlp_ratio) != hp.n_layer:
            raise ValueError(f"model.mlp_ratio has {len(hp.mlp_ratio)} entries for n_layer={hp.n_layer} blocks")
        if hp.attention not in ("dense", "sparse"):
            raise ValueError(f"model.attention={hp.attention!r} must be 'dense' or 'sparse'")
        if hp.mod_every < 0 or hp.moe_every < 1:
            raise ValueError(f"model.mod_every={hp.mod_every} must be >= 0 and model.moe_every={hp.moe_every} >= 1")
        if not 0.0 < hp.mod_capacity <= 1.0:
            raise ValueError(f"model.mod_capacity={hp.mod_capacity} must be in (0, 1]")
        if hp.n_experts > 1 and not 1 <= hp.moe_top_k <= hp.n_experts:
            raise ValueError(f"model.moe_top_k={hp.moe_top_k} must be between 1 and model.n_experts={hp.n_experts}")
        if hp.moe_capacity_factor is not None and hp.moe_capacity_factor <= 0:
            raise ValueError(f"model.moe_capacity_factor={hp.moe_capacity_factor} must be > 0 (or null: dropless)")
        if hp.attention == "sparse" and hp.block_size > hp.attn_block and hp.block_size % hp.attn_block:
            raise ValueError(
                f"sequence length model.block_size={hp.block_size} is not a multiple of model.attn_block="
                f"{hp.attn_block}: choose an attention block size that divides it"
            )

    def configure_dynamics(self, **options: Any) -> None:
        """Switch on dynamic structure before the layers are built (how the dynamics callbacks enable it).

        Args:
            **options: any of the constructor's dynamic arguments (``early_exit``, ``mod_every``, ``n_experts``,
                ``attention``, ...).

        Raises:
            RuntimeError: the layers already exist (pass the options to the constructor instead).
            ValueError: an unknown option or a bad value.
        """
        unknown = set(options) - _DYNAMIC_OPTIONS
        if unknown:
            raise ValueError(f"unknown dynamic options {sorted(unknown)}; valid: {sorted(_DYNAMIC_OPTIONS)}")
        changed = {k: v for k, v in options.items() if self.hparams[k] != v}
        if not changed:
            return
        if self.blocks is not None:
            raise RuntimeError(
                f"the GPT's layers are already built, so {sorted(changed)} cannot change; give them to GPT(...)"
            )
        self.hparams.update(changed)
        self._check_hparams()

    @property
    def carries_state(self) -> bool:
        """Whether activations carry ``(hidden, active, aux)`` between layers (some block needs it)."""
        hp = self.hparams
        return bool(hp.early_exit or hp.mod_every or hp.n_experts > 1)

    def _block(self, i: int, hidden: int) -> Block:
        hp = self.hparams
        attn = mlp = None
        if hp.attention == "sparse":
            attn = SparseCausalSelfAttention(
                hp.n_embd,
                hp.n_head,
                hp.dropout,
                hp.bias,
                attn_block=hp.attn_block,
                density=hp.attn_density,
                target_coverage=hp.attn_target_coverage,
            )
        if hp.n_experts > 1 and (i + 1) % hp.moe_every == 0:
            mlp = MoEMLP(
                hp.n_embd,
                hidden,
                hp.n_experts,
                top_k=hp.moe_top_k,
                capacity_factor=hp.moe_capacity_factor,
                aux_loss_coef=hp.moe_aux_coef,
                z_loss_coef=hp.moe_z_coef,
                dropout=hp.dropout,
                bias=hp.bias,
            )
        routed = hp.mod_every and (i + 1) % hp.mod_every == 0
        return Block(
            hp.n_embd,
            hp.n_head,
            hidden,
            hp.dropout,
            hp.bias,
            attn=attn,
            mlp=mlp,
            early_exit=hp.early_exit,
            mod_capacity=hp.mod_capacity if routed else None,
        )

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline protocol
    # ----------------------------------------------------------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        """Embedding, the blocks, and the head, in order."""
        if self.blocks is None:
            self.configure_model()
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor | tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        """Mean next-token cross-entropy of one micro-batch, plus the carried auxiliary losses (MoE, MoD)."""
        logits, aux = output if isinstance(output, tuple) else (output, None)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return loss if aux is None else loss + aux.sum()

    def pipeline_init_layer(self, index: int, layer: nn.Module) -> None:
        """GPT-2 initialisation; residual projections are scaled down by ``1/sqrt(2 * n_layer)``."""
        std = 0.02
        for name, p in layer.named_parameters():
            if isinstance(layer, Head) and name == "lm_head.weight" and self.hparams.tie_embeddings:
                continue  # the embedding's initialisation is the tie's value
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.hparams.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
        # Buffers of dynamic parts (thresholds, capacities, densities) start from their configured values.
        for module in layer.modules():
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Adapt the densities of the sparse attention layers this process holds (one device read for all)."""
        adapt_densities(m for m in self.modules() if isinstance(m, SparseCausalSelfAttention))

    def configure_optimizers(self) -> Any:
        """AdamW with two groups (matrices decayed; biases, norms, embeddings not) and optional warm-up/cosine.

        The two groups always exist, even empty, so that every pipeline stage has the same group layout (needed to
        move optimizer state between stages and to write stage-independent checkpoints).
        """
        hp = self.hparams
        decay, no_decay = [], []
        # Embeddings are not decayed, the tied output projection included: a stage holding only the head (a copy of
        # the tie) must put it in the same group as the stage holding the embedding.
        embeddings = {"embed.wte.weight", "embed.wpe.weight"}
        if hp.tie_embeddings:
            embeddings.add("head.lm_head.weight")
        for name, p in self.named_parameters():
            is_matrix = p.dim() >= 2 and name not in embeddings
            (decay if is_matrix else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        if hp.warmup_steps <= 0 and hp.lr_decay_steps is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _WarmupCosine(hp.warmup_steps, hp.lr_decay_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: Constructor arguments that shape dynamic structure (see :meth:`GPT.configure_dynamics`).
_DYNAMIC_OPTIONS = {
    "early_exit",
    "mod_every",
    "mod_capacity",
    "n_experts",
    "moe_every",
    "moe_top_k",
    "moe_capacity_factor",
    "moe_aux_coef",
    "moe_z_coef",
    "attention",
    "attn_block",
    "attn_density",
    "attn_target_coverage",
}


class _WarmupCosine:
    """Linear warm-up then cosine decay to ``min_ratio``; picklable so the scheduler state checkpoints cleanly."""

    def __init__(self, warmup: int, decay: int | None, min_ratio: float) -> None:
        self.warmup, self.decay, self.min_ratio = warmup, decay, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.decay is None:
            return 1.0
        t = min(1.0, (step - self.warmup) / max(1, self.decay))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
