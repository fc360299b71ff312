"""A GPT whose blocks 1 and 2 tie their MLP input weights by declaration (how a model that ties by copying says so).
Importable by the test workers as ``support.tied_blocks`` (tests/ is on their path)."""

from dynmo_lightning.models import GPT


class TiedBlocksGPT(GPT):
    def pipeline_tied_parameters(self) -> list[list[str]]:
        return [["blocks.1.mlp.fc.weight", "blocks.2.mlp.fc.weight"]]


class DecayedHeadGPT(GPT):
    """Ties the embeddings but puts the head's copy in the weight-decay group: a grouping the strategy must refuse."""

    def configure_optimizers(self):
        import torch

        embeddings = ("embed.wte.weight", "embed.wpe.weight")
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and n not in embeddings]
        rest = [p for p in self.parameters() if not any(p is q for q in decay)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-3)
