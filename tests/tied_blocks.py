"""A GPT whose blocks 1 and 2 tie their MLP input weights by declaration (how a model that ties by copying says so).
Importable by the test workers (tests/ is on their path)."""

from dynmo_lightning.models import GPT


class TiedBlocksGPT(GPT):
    def pipeline_tied_parameters(self) -> list[list[str]]:
        return [["blocks.1.mlp.fc.weight", "blocks.2.mlp.fc.weight"]]
