"""Reference models implementing the pipeline protocol."""

from dynmo_lightning.models.gpt import GPT

__all__ = ["GPT"]
