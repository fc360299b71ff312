"""Hugging Face causal LMs (GPT-2; Llama, Mistral, Qwen2) as pipeline models: ``from_hf(model_or_config)``.

Needs the optional ``transformers`` package (``pip install 'dynmo-lightning[hf]'``), imported only when a model is
built or saved, so the rest of the package works without it.
"""

from dynmo_lightning.models.hf.layers import DecoderLayer, Embedding, Head
from dynmo_lightning.models.hf.model import HFCausalLM, from_hf, save_hf, shift_labels, to_hf_keys

__all__ = ["DecoderLayer", "Embedding", "HFCausalLM", "Head", "from_hf", "save_hf", "shift_labels", "to_hf_keys"]
