"""The schedules of ``torch.distributed.pipelining`` a pipeline may run, and what each needs of its sizes."""

from __future__ import annotations

from typing import Literal

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from dynmo_lightning.balance.split.placement import V_SCHEDULES

#: What ``DynMoStrategy(schedule=...)`` accepts (the keys of :data:`SCHEDULES`).
ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]

#: Schedule names accepted by :class:`PipelineRuntime` (and ``DynMoStrategy(schedule=...)``).
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

#: Schedules that split each backward into its input part and its weight part (zero-bubble: the weight part fills
#: the bubbles). Their weight part sets ``.grad`` itself, past DDP's hooks: replicas need ``data_parallel="fsdp"``
#: or ``"replicate"``, whose reduction the pipeline stage runs itself after the last weight pass.
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")

#: Schedules that run several stages per rank (torch's multi-stage schedules).
MULTI_STAGE = ("interleaved_1f1b", *SPLIT_BACKWARD)


def check_schedule(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """Raise a clear ``ValueError`` when the schedule cannot run with these sizes (before any process waits)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"strategy.schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
    if n_microbatches < 1:
        raise ValueError(f"strategy.n_microbatches={n_microbatches} must be >= 1")
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        _check_interleaved(schedule, n_ranks, n_stages, n_microbatches)
    elif schedule in V_SCHEDULES:
        _check_v(schedule, n_ranks, n_stages, n_microbatches)
    elif n_stages != n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} runs one stage per rank; stages_per_rank > 1 needs one of "
            f"{list(MULTI_STAGE)}"
        )
    if schedule == "1f1b" and n_microbatches < n_ranks:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} < {n_ranks} pipeline ranks: 1F1B needs at least one "
            "micro-batch per stage; raise n_microbatches or use schedule='gpipe'"
        )


def _check_interleaved(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """The sizes torch's looped multi-stage schedules accept (interleaved 1F1B and interleaved zero-bubble)."""
    if n_ranks < 2:
        # torch's runtime cannot evaluate (forward only) adjacent stages that share a rank.
        raise ValueError(f"strategy.schedule={schedule!r} needs at least 2 processes; use '1f1b' on one")
    if n_stages == n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} needs several stages per rank: set "
            "strategy.stages_per_rank >= 2 (or use schedule='1f1b')"
        )
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} does not work with strategy.schedule={schedule!r} on "
            f"{n_ranks} ranks: it must be a multiple of n_microbatches // ranks = {rounds}; use a multiple of {n_ranks}"
        )


def _check_v(schedule: str, n_ranks: int, n_stages: int, n_microbatches: int) -> None:
    """The sizes torch's V-shaped schedules accept (ZBV zero-bubble and DualPipeV): two stages per rank."""
    if n_ranks < 2:
        raise ValueError(f"strategy.schedule={schedule!r} needs at least 2 processes; use '1f1b' on one")
    if n_stages != 2 * n_ranks:
        raise ValueError(
            f"strategy.schedule={schedule!r} places exactly two stages on every rank in a V (stages s and "
            f"2P-1-s on rank s): set strategy.stages_per_rank=2, got {n_stages // n_ranks}"
        )
    if schedule == "dualpipev" and n_microbatches < n_stages:
        raise ValueError(
            f"strategy.n_microbatches={n_microbatches} < {n_stages} stages: DualPipeV needs at least one "
            f"micro-batch per stage; set strategy.n_microbatches >= {n_stages} (2 x processes)"
        )
