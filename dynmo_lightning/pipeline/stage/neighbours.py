"""Diffusion balancing at runtime: one protocol stage per process, cards sent point-to-point to pipeline neighbours.

The protocol itself is pure and lives in :mod:`dynmo_lightning.balance.diffusion.driver` (:class:`DiffusionStage`); this
room only carries its cards. Every round, each process sends its stage's card (one small float64 tensor) to the
previous and the next process of its pipeline and receives theirs (``dist.batch_isend_irecv`` on the pipeline's CPU
control group: cards are host data, and thousands of rounds must not each copy to a GPU and read back), so no
process ever sees another stage's layer costs but the boundary layers a neighbour shows (and, in
sweep mode, sums over runs of a stage's layers: at most ``2 P - 1`` of them for the whole model). The stages
end in the same round by themselves; the one collective is a termination check on one scalar (the round count,
all-reduced with ``MAX``), which turns a disagreement into an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from dynmo_lightning.balance.diffusion.driver import Card, DiffusionStage, StageOutcome
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup, group_device


@dataclasses.dataclass(frozen=True)
class NeighbourStats:
    """What one process's run of the protocol cost and found.

    Attributes:
        outcome: every stage's result (the new split and per-stage sums), the same on every process.
        rounds: synchronous rounds.
        probes: bounds the search probed (0 for a sweep-mode run that needed no exact fallback).
        bytes_sent: bytes this process sent (cards to its neighbours).
        seconds: wall time of the rounds and the termination check.
    """

    outcome: list[StageOutcome]
    rounds: int
    probes: int
    bytes_sent: int
    seconds: float

    @property
    def layers_per_stage(self) -> list[int]:
        """The split the stages agreed on."""
        return [o.size for o in self.outcome]


def run_stage(stage: DiffusionStage, pipe: PipelineGroup) -> NeighbourStats:
    """Drive this process's ``stage`` to the end, exchanging cards with the pipeline neighbours (collective).

    Args:
        stage: this process's protocol stage (its index is the pipeline rank).
        pipe: the pipeline (the cards go over its control group).

    Returns:
        The outcome and what the run cost.

    Raises:
        RuntimeError: if the stages did not end in the same round.
    """
    if stage.stage != pipe.rank or stage.n_stages != pipe.size:
        raise ValueError(f"stage {stage.stage} of {stage.n_stages} does not run on pipeline rank {pipe.rank}")
    t0, group = time.perf_counter(), pipe.control
    device = group_device(torch.device("cpu"), group)
    peers = [pipe.global_rank(r) if 0 <= r < pipe.size else None for r in (pipe.rank - 1, pipe.rank + 1)]
    width = stage.card_floats  # fixed for the run: every card (and every inbox) has this many floats
    sent = 0
    while stage.card is not None:
        sent += _exchange_cards(stage, stage.card, peers, width, group, device)
    _check_same_rounds(stage, pipe, device)
    assert stage.outcome is not None
    return NeighbourStats(stage.outcome, stage.rounds, stage.probes, sent, time.perf_counter() - t0)


def _exchange_cards(
    stage: DiffusionStage,
    card: Card,
    peers: list[int | None],
    width: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> int:
    """One round: send ``card`` to both neighbours, receive theirs, and step ``stage`` with them.

    Args:
        stage: this process's protocol stage.
        card: the stage's card of this round.
        peers: global ranks of the previous and the next process of the pipeline (``None``: no such neighbour).
        width: floats of one encoded card (:attr:`DiffusionStage.card_floats`).
        group: the pipeline's control group the cards go over.
        device: where the group's tensors live (:func:`group_device`).

    Returns:
        Bytes this process sent this round.
    """
    out = torch.tensor(card.encode(stage.slots), dtype=torch.float64, device=device)
    inbox = [torch.empty(width, dtype=torch.float64, device=device) if p is not None else None for p in peers]
    ops = []
    for peer, buffer in zip(peers, inbox, strict=True):
        if peer is not None and buffer is not None:
            ops += [dist.P2POp(dist.isend, out, peer, group), dist.P2POp(dist.irecv, buffer, peer, group)]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    left, right = (_card(buffer, stage.width, stage.slots) for buffer in inbox)
    stage.step(left, right)
    return 8 * width * (len(ops) // 2)


def _check_same_rounds(stage: DiffusionStage, pipe: PipelineGroup, device: torch.device) -> None:
    """The termination check: every stage of the pipeline ended in the same round (collective over the pipeline).

    Args:
        stage: this process's protocol stage, ended.
        pipe: the pipeline (the check runs over its control group).
        device: where the control group's tensors live.

    Raises:
        RuntimeError: if another stage ended in a later round.
    """
    rounds = torch.tensor([float(stage.rounds)], dtype=torch.float64, device=device)
    # the one collective: a MAX turns a disagreement into an error instead of a hang
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=pipe.control)
    if int(rounds.item()) != stage.rounds:
        raise RuntimeError(f"pipeline rank {pipe.rank} ended diffusion after {stage.rounds} rounds, another later")


def _card(buffer: torch.Tensor | None, width: int, slots: int) -> Card | None:
    return None if buffer is None else Card.decode(buffer.tolist(), width, slots)
