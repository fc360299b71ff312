"""Which pipeline rank runs each stage, per schedule: the one stage-to-rank mapping the planner and runtime share.

Looped schedules (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) place stage ``s`` on rank ``s % R``.
V-shaped schedules (torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``) hold exactly two stages per rank,
stage ``s`` and stage ``2R - 1 - s`` on rank ``s``: the first and the last stage share rank 0, so the loss is
computed where the input enters and the activations turn around at rank ``R - 1`` without a hop.
"""

from __future__ import annotations

#: Schedules whose stages sit on the ranks in a V (two per rank); every other schedule loops.
V_SCHEDULES = ("zbv", "dualpipev")


def stage_ranks(schedule: str, n_ranks: int, stages_per_rank: int = 1) -> list[int]:
    """The pipeline rank of every stage, in stage order.

    Args:
        schedule: a schedule name (``"1f1b"``, ``"zbv"``, ...); names outside :data:`V_SCHEDULES` loop.
        n_ranks: pipeline ranks ``R >= 1``.
        stages_per_rank: stages each rank holds (exactly 2 for the V schedules).

    Returns:
        ``n_ranks * stages_per_rank`` ranks, entry ``s`` being the rank of stage ``s``.

    Raises:
        ValueError: for ``n_ranks < 1`` or ``stages_per_rank < 1``, or a V schedule with ``stages_per_rank != 2``.
    """
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks!r}")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an integer >= 1, got {stages_per_rank!r}")
    n_stages = n_ranks * stages_per_rank
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(
                f"schedule={schedule!r} places two stages on every rank in a V: set stages_per_rank=2, "
                f"got {stages_per_rank}"
            )
        return [s if s < n_ranks else n_stages - 1 - s for s in range(n_stages)]
    return [s % n_ranks for s in range(n_stages)]


def rank_stages(schedule: str, n_ranks: int, stages_per_rank: int = 1) -> list[list[int]]:
    """The stages of every rank, in stage order (the inverse of :func:`stage_ranks`)."""
    owned: list[list[int]] = [[] for _ in range(n_ranks)]
    for stage, rank in enumerate(stage_ranks(schedule, n_ranks, stages_per_rank)):
        owned[rank].append(stage)
    return owned
