"""The reference GPT trained by plain SGD (Hydra target ``support.sgd_gpt.SGDGPT``), for exactness runs that can see
a wrong gradient scale: AdamW normalises a gradient scaled by a constant away, and clipping by norm hides it too (run
it with ``trainer.gradient_clip_val=null``). Momentum gives the optimizer a state that moves with each layer.
"""

from __future__ import annotations

from typing import Any

import torch

from dynmo_lightning.models import GPT


class SGDGPT(GPT):
    """The reference GPT with SGD (momentum 0.9) in place of AdamW, in the same two parameter groups."""

    def configure_optimizers(self) -> Any:
        groups = super().configure_optimizers()
        adam = groups if isinstance(groups, torch.optim.Optimizer) else groups["optimizer"]
        # the same groups (every stage has both, even empty), so layers and their state move as under AdamW
        return torch.optim.SGD(
            [{"params": g["params"], "weight_decay": 0.0} for g in adam.param_groups], lr=0.1, momentum=0.9
        )
