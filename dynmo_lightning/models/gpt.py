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
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

from dynmo_lightning.optim import index_select_
from dynmo_lightning.protocol import PipelineModule, init_layer


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` token ids to ``(B, T, C)`` hidden states."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        """Embed token ids ``(B, T)``."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on ``(B, T, C)`` hidden states.

    Structured pruning removes whole heads (:meth:`keep_units`): the projections shrink, so attention costs fall
    with the number of heads left.
    """

    unit_kind = "head"

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.initial_units = n_head
        self.head_dim = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_head * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally over ``(B, T, C)``."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)))

    def _rows(self, heads: Tensor) -> Tensor:
        """Rows of ``qkv`` (laid out ``[3, n_head, head_dim]``) that belong to ``heads``, in layout order."""
        d = torch.arange(self.head_dim, device=heads.device)
        per_head = (heads[:, None] * self.head_dim + d).reshape(-1)
        return torch.cat([c * self.n_head * self.head_dim + per_head for c in range(3)])

    def unit_scores(self) -> Tensor:
        """L2 norm of each head's query/key/value rows and output-projection columns."""
        heads = torch.arange(self.n_head, device=self.qkv.weight.device)
        rows = self.qkv.weight.detach().square().sum(1)
        if self.qkv.bias is not None:
            rows = rows + self.qkv.bias.detach().square()
        per_head = rows.view(3, self.n_head, self.head_dim).sum((0, 2))
        cols = self.proj.weight.detach().square().sum(0).view(self.n_head, self.head_dim).sum(1)
        return (per_head + cols)[heads].sqrt()

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only the heads ``keep`` (ascending indices), slicing weights and their optimizer state in place."""
        rows = self._rows(keep)
        index_select_(self.qkv.weight, 0, rows, optimizers)
        if self.qkv.bias is not None:
            index_select_(self.qkv.bias, 0, rows, optimizers)
        cols = (keep[:, None] * self.head_dim + torch.arange(self.head_dim, device=keep.device)).reshape(-1)
        index_select_(self.proj.weight, 1, cols, optimizers)
        self._set_heads(len(keep))

    def _set_heads(self, n_head: int) -> None:
        self.n_head = n_head
        self.qkv.out_features = 3 * n_head * self.head_dim
        self.proj.in_features = n_head * self.head_dim

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A checkpoint of a pruned model has fewer heads: take its shapes before its values.
        w = state_dict.get(prefix + "qkv.weight")
        if w is not None and w.shape != self.qkv.weight.shape:
            heads = w.shape[0] // (3 * self.head_dim)
            _resize(self.qkv.weight, tuple(w.shape))
            if self.qkv.bias is not None:
                _resize(self.qkv.bias, (w.shape[0],))
            _resize(self.proj.weight, (self.proj.weight.shape[0], heads * self.head_dim))
            self._set_heads(heads)
        super()._load_from_state_dict(state_dict, prefix, *args)


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU.

    Structured pruning removes hidden neurons (:meth:`keep_units`): both matrices shrink, so the MLP's cost falls with
    the fraction of neurons kept.
    """

    unit_kind = "neuron"

    def __init__(self, n_embd: int, hidden: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.initial_units = hidden
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP position-wise."""
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def unit_scores(self) -> Tensor:
        """L2 norm of each hidden neuron's input row, bias and output column."""
        score = self.fc.weight.detach().square().sum(1) + self.proj.weight.detach().square().sum(0)
        if self.fc.bias is not None:
            score = score + self.fc.bias.detach().square()
        return score.sqrt()

    def keep_units(self, keep: Tensor, optimizers: Sequence[Optimizer] = ()) -> None:
        """Keep only the hidden neurons ``keep`` (ascending), slicing weights and their optimizer state in place."""
        index_select_(self.fc.weight, 0, keep, optimizers)
        if self.fc.bias is not None:
            index_select_(self.fc.bias, 0, keep, optimizers)
        index_select_(self.proj.weight, 1, keep, optimizers)
        self.fc.out_features = self.proj.in_features = len(keep)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A checkpoint of a pruned model has fewer neurons: take its shapes before its values.
        w = state_dict.get(prefix + "fc.weight")
        if w is not None and w.shape != self.fc.weight.shape:
            hidden = w.shape[0]
            _resize(self.fc.weight, tuple(w.shape))
            if self.fc.bias is not None:
                _resize(self.fc.bias, (hidden,))
            _resize(self.proj.weight, (self.proj.weight.shape[0], hidden))
            self.fc.out_features = self.proj.in_features = hidden
        super()._load_from_state_dict(state_dict, prefix, *args)


def _resize(param: nn.Parameter, shape: tuple[int, ...]) -> None:
    """Give ``param`` a new shape in place (values follow from the state dict being loaded)."""
    param.data = param.data.new_empty(shape)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, mlp_hidden: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, mlp_hidden, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to hidden states ``(B, T, C)``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and projection to vocabulary logits."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, T, V)``."""
        return self.lm_head(self.ln_f(x))


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
    ) -> None:
        super().__init__()
        if n_layer < 1:
            raise ValueError(f"model.n_layer={n_layer}: a GPT needs at least one block")
        if isinstance(mlp_ratio, (list, tuple)) and len(mlp_ratio) != n_layer:
            raise ValueError(f"model.mlp_ratio has {len(mlp_ratio)} entries for n_layer={n_layer} blocks")
        self.save_hyperparameters()
        self.pipeline_init_seed = init_seed
        self.embed: Embedding | None = None
        self.blocks: nn.ModuleList | None = None
        self.head: Head | None = None

    def configure_model(self) -> None:
        """Create the layers (on the meta device under a pipeline strategy, else initialised right here)."""
        if self.blocks is not None:
            return
        hp = self.hparams
        self.embed = Embedding(hp.vocab_size, hp.block_size, hp.n_embd, hp.dropout)
        ratios = hp.mlp_ratio if isinstance(hp.mlp_ratio, (list, tuple)) else [hp.mlp_ratio] * hp.n_layer
        self.blocks = nn.ModuleList(Block(hp.n_embd, hp.n_head, r * hp.n_embd, hp.dropout, hp.bias) for r in ratios)
        self.head = Head(hp.n_embd, hp.vocab_size, hp.bias)
        for i, layer in enumerate(self.pipeline_layers()):
            if not any(p.is_meta for p in layer.parameters()):
                init_layer(self, i, layer, self.pipeline_init_seed)

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline protocol
    # ----------------------------------------------------------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        """Embedding, the blocks, and the head, in order."""
        if self.blocks is None:
            self.configure_model()
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean next-token cross-entropy of one micro-batch."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def pipeline_init_layer(self, index: int, layer: nn.Module) -> None:
        """GPT-2 initialisation; residual projections are scaled down by ``1/sqrt(2 * n_layer)``."""
        std = 0.02
        for name, p in layer.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.hparams.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def configure_optimizers(self) -> Any:
        """AdamW with two groups (matrices decayed; biases, norms, embeddings not) and optional warm-up/cosine.

        The two groups always exist, even empty, so that every pipeline stage has the same group layout (needed to
        move optimizer state between stages and to write stage-independent checkpoints).
        """
        hp = self.hparams
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            is_matrix = p.dim() >= 2 and ".wte." not in f".{name}" and ".wpe." not in f".{name}"
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
