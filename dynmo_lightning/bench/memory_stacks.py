"""A model as the memory emulator builds it (:class:`Stack`), and the causal LMs it measures: the GPT and a Llama."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


@dataclasses.dataclass
class Stack:
    """A model as the emulator builds it: its layers one by one, its micro-batch input and loss.

    Attributes:
        n_layers: pipeline layers.
        layer: builds layer ``i`` (called under ``FakeTensorMode``).
        microbatch: the first layer's input of one micro-batch, and its target.
        loss: ``(last layer's output, target) -> loss``.
        autocast: run forward and backward under bf16 autocast (``precision="bf16-mixed"``).
    """

    n_layers: int
    layer: Callable[[int], nn.Module]
    microbatch: Callable[[], tuple[tuple[Tensor, ...], Tensor]]
    loss: Callable[[Any, Tensor], Tensor]
    autocast: bool = False


def _language_model(
    n_layers: int, layer: Callable[[int], nn.Module], microbatch: int, seq: int, autocast: bool
) -> Stack:
    """A causal LM's :class:`Stack`: token ids in (their own targets), cross-entropy over the vocabulary out."""

    def batch() -> tuple[tuple[Tensor, ...], Tensor]:
        ids = torch.zeros(microbatch, seq, dtype=torch.long)
        return (ids,), ids

    def loss(logits: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    return Stack(n_layers, layer, batch, loss, autocast)


def gpt_stack(
    n_layer: int, n_embd: int, n_head: int, seq: int, vocab: int, microbatch: int = 1, autocast: bool = False
) -> Stack:
    """The reference GPT (untied) as a :class:`Stack`: embedding, ``n_layer`` blocks, head."""
    from dynmo_lightning.models.blocks import Block, Embedding, Head

    def layer(i: int) -> nn.Module:
        if i == 0:
            return Embedding(vocab, seq, n_embd, 0.0)
        if i == n_layer + 1:
            return Head(n_embd, vocab, True)
        return Block(n_embd, n_head, 4 * n_embd, 0.0, True)

    return _language_model(n_layer + 2, layer, microbatch, seq, autocast)


def llama_stack(
    n_layer: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seq: int,
    microbatch: int = 1,
    autocast: bool = True,
) -> Stack:
    """A Hugging Face Llama as :func:`~dynmo_lightning.models.hf.from_hf` splits it: embedding, decoder layers, head.

    Each layer comes from a one-layer ``LlamaForCausalLM`` of the same shapes (a decoder layer does not depend on
    its index), so building one layer never builds the whole model.
    """
    from dynmo_lightning.models.hf import layers as hf_layers
    from dynmo_lightning.models.hf.model import _family, transformers

    tf = transformers()
    config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=vocab,
                            max_position_embeddings=seq, tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    family = _family(config)

    def layer(i: int) -> nn.Module:
        model = tf.LlamaForCausalLM(config)
        if i == 0:
            return hf_layers.Embedding(model.model.embed_tokens)
        if i == n_layer + 1:
            return hf_layers.Head(model.model.norm, model.lm_head)
        return hf_layers.DecoderLayer(model.model.layers[0], family, model.model.rotary_emb, "sdpa")

    return _language_model(n_layer + 2, layer, microbatch, seq, autocast)
