"""A GPT whose MoE layers run expert by expert (``MoEMLP.grouped = False``), so experts no token reached get no
gradient at all, as on a GPU without grouped GEMMs (on the CPU the grouped GEMM gives every expert one).

Hydra target: ``model._target_=support.moe_models.PerExpertGPT``.
"""

from __future__ import annotations

from dynmo_lightning.models import GPT
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.models.moe import MoEMLP


class PerExpertGPT(GPT):
    def _block(self, i: int, hidden: int) -> Block:
        block = super()._block(i, hidden)
        for m in block.modules():
            if isinstance(m, MoEMLP):
                m.grouped = False
        return block
