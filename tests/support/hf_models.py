"""Tiny Hugging Face models, their data and training, shared by tests/models/test_hf.py and tests/support/_hf_script.py.

The reference is plain single-device Lightning training the Hugging Face model through its own ``forward``
(:class:`PlainHF`); pipeline runs train ``from_hf`` of the same model under DynMoStrategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning.bench.timeline import Losses
from dynmo_lightning.models.hf import from_hf, to_hf_keys

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 12
LR, WEIGHT_DECAY = 1e-3, 0.1

CONFIGS = {
    # grouped KV heads (4 query heads, 2 KV heads), untied
    "llama": dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    # tied embeddings (GPT-2's default), dropout off so runs compare exactly
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
}


def hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The plain Hugging Face model of a family (config ``overrides``) with the weights ``from_hf`` gives it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**CONFIGS[family], **overrides}
    module = built(from_hf(config, seed=seed))
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.load_state_dict(module.hf_state_dict())
    return model


def built(module: L.LightningModule) -> L.LightningModule:
    """``module`` with its layers materialised, as a Trainer without a pipeline strategy leaves it."""
    module.configure_model()
    return module


def loader() -> DataLoader:
    """Sequences with structure (a noisy counting pattern) so the loss falls; pairs (input_ids, next tokens)."""
    g = torch.Generator().manual_seed(3)
    n = BATCH * STEPS
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + step * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH, drop_last=True)


def decay_groups(named: list[tuple[str, torch.nn.Parameter]], embeddings: set[str]) -> list[dict[str, Any]]:
    decay = [p for n, p in named if p.dim() >= 2 and n not in embeddings]
    rest = [p for n, p in named if not (p.dim() >= 2 and n not in embeddings)]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


class PlainHF(L.LightningModule):
    """The Hugging Face model trained through its own forward, as a user would without DynMo."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.hf = hf_model(family)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.hf(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        embeddings = {"hf.transformer.wte.weight", "hf.transformer.wpe.weight", "hf.model.embed_tokens.weight"}
        return torch.optim.AdamW(decay_groups(list(self.named_parameters()), embeddings), lr=LR, betas=(0.9, 0.95))


def fit(module: L.LightningModule, strategy: Any = "auto", devices: int = 1, callbacks=()) -> tuple[L.Trainer, list]:
    """Train ``module`` for STEPS steps (clipped); returns the trainer and the per-step losses."""
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[losses, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader())
    return trainer, losses.values


def pipeline_model(family: str) -> L.LightningModule:
    return from_hf(CONFIGS[family], seed=0, lr=LR, weight_decay=WEIGHT_DECAY, attn_implementation="sdpa")


def reference(family: str) -> dict[str, Any]:
    """Plain single-device Lightning: losses and the final weights under Hugging Face names."""
    module = PlainHF(family)
    _, losses = fit(module)
    return {"losses": losses, "state": {k: v.clone() for k, v in module.hf.state_dict().items()}}


def hf_state(state_dict: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """A pipeline module's state dict under the Hugging Face names."""
    return to_hf_keys(state_dict, pipeline_model(family).family)[0]


def save(trainer: L.Trainer, losses: list[float], path: Path) -> None:
    trainer.save_checkpoint(path.with_suffix(".ckpt"))
    if trainer.is_global_zero:
        path.write_text(json.dumps({"losses": losses}))
