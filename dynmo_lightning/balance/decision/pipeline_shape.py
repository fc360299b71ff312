"""The pipeline a balancing policy plans for: its split, ranks, micro-batches, schedule and FSDP2 memory way."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """The pipeline a policy plans for.

    Attributes:
        layers_per_stage: the split in force.
        n_ranks: processes of the pipeline (stage ``s`` runs on the rank
            :func:`~dynmo_lightning.balance.split.placement.stage_ranks` gives: ``s % n_ranks``, or the V of
            ZBV/DualPipeV).
        n_microbatches: micro-batches per step.
        schedule: a schedule of :data:`~dynmo_lightning.balance.steptime.makespan.SCHEDULES` (its task order is what the
            step time of every decision is simulated from).
        param_counts: parameters of each layer (for ``method="params"``).
        nodes: the node each rank runs on (a repack then frees whole nodes); ``None``: unknown.
        waiting: released ranks that wait and may be re-admitted (a grow adds up to this many stages).
        fsdp_memory: how FSDP2 units hold a step's weights and gradients now, ``"fast"`` or ``"lean"``
            (``StrategySettings.fsdp_memory``).
        fsdp_memory_auto: whether a check chooses it (``fsdp_memory="auto"``:
            :meth:`~dynmo_lightning.balance.decision.policy.BalancePolicy.choose_fsdp_memory`).
    """

    layers_per_stage: list[int]
    n_ranks: int
    n_microbatches: int
    schedule: str = "1f1b"
    param_counts: Sequence[int] | None = None
    nodes: Sequence[Hashable] | None = None
    waiting: int = 0
    fsdp_memory: str = "fast"
    fsdp_memory_auto: bool = False

    @property
    def n_stages(self) -> int:
        """Stages of the split in force."""
        return len(self.layers_per_stage)

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank runs (more than one: interleaved and V schedules)."""
        return max(1, self.n_stages // self.n_ranks)

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations a stage may hold at once under the schedule."""
        return self.n_microbatches if self.schedule == "gpipe" else min(self.n_microbatches, self.n_stages)
