"""What composes with what: the one table of combinations a job refuses, and why.

A job is a pipeline whose stages are split by tensor parallelism, replicated by DDP, replicate or FSDP2, run by a
schedule, and changed while it trains (consolidation, released processes, growing back). Most combinations work
(docs/scale_out.md's matrix, checked by ``tests/test_composition.py``); the few that cannot are rows of
:data:`REFUSALS`, each a row of docs/errors.md with the settings it names and the reason. The strategy's
constructor asks :func:`refuse` with its settings and the balancer's pre-launch check with the balancer's: both
before any worker starts, with one message and no traceback from ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Composition:
    """The settings that meet in a job (defaults: what a setting not known at a check is).

    Attributes:
        data_parallel: ``strategy.data_parallel`` (``"ddp"``, ``"replicate"`` or ``"fsdp"``).
        data_parallel_size: replicas (``D``).
        tensor_parallel_size: processes a stage is split over (``T``).
        schedule: ``strategy.schedule``.
        split_backward: the schedule splits every backward into an input and a weight pass (zero-bubble, V).
        stages_per_rank: ``strategy.stages_per_rank``.
        fsdp_memory: ``strategy.fsdp_memory``.
        repack: ``balancer.repack`` (consolidation onto fewer processes).
        on_release: ``balancer.on_release``.
        min_stages: ``balancer.min_stages``.
        tied_ends: the first and the last pipeline layer share a parameter (tied embeddings).
        on_peer_lost: ``strategy.on_peer_lost`` (``"stop"`` or ``"recover"``).
    """

    data_parallel: str = "ddp"
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    schedule: str = "1f1b"
    split_backward: bool = False
    stages_per_rank: int = 1
    fsdp_memory: str = "fast"
    repack: bool = False
    on_release: str = "exit"
    min_stages: int = 1
    tied_ends: bool = False
    on_peer_lost: str = "stop"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A row of docs/errors.md: when a composition cannot run, what the user is told, and an example of it.

    Attributes:
        row: its number in docs/errors.md.
        applies: whether a composition is refused by it.
        message: what the user reads (the settings, the reason, the fix).
        example: a composition it refuses (the tests ask each row of it).
    """

    row: int
    applies: Callable[[Composition], bool]
    message: Callable[[Composition], str]
    example: Composition


def _split_backward_under_ddp(c: Composition) -> str:
    # torch's weight pass assigns `.grad` itself, past the gradient hooks DDP's reducer averages in; the pipeline
    # stage runs FSDP2's and replicate's reduction itself after the last weight pass.
    return (
        f"strategy.schedule={c.schedule!r} splits every backward into an input and a weight pass, and the weight pass "
        "bypasses DDP's gradient averaging. With replicas set strategy.data_parallel='fsdp' (or 'replicate'), or "
        "use schedule='interleaved_1f1b' (or '1f1b') with DDP."
    )


def _tensor_parallel_under_ddp(c: Composition) -> str:
    # DDP's reducer averages plain tensors; split layers hold DTensors, which FSDP2's units reduce (2-D).
    return (
        f"strategy.tensor_parallel_size={c.tensor_parallel_size} with data_parallel_size={c.data_parallel_size} "
        "needs strategy.data_parallel='fsdp' (or 'replicate'): DDP cannot average the gradients of layers split over "
        "processes (DTensors)."
    )


def _lean_without_fsdp(c: Composition) -> str:
    return (
        f"strategy.fsdp_memory={c.fsdp_memory!r} shards gradients per micro-batch, which only data_parallel='fsdp' "
        f"does: set strategy.data_parallel='fsdp', or leave strategy.fsdp_memory='fast' (got "
        f"data_parallel={c.data_parallel!r})"
    )


def _lean_with_split_backward(c: Composition) -> str:
    # the input pass would free the gathered weights its own weight pass still needs
    return (
        f"strategy.fsdp_memory={c.fsdp_memory!r} with strategy.schedule={c.schedule!r}: a split backward computes the "
        "weights' gradients in a later pass, after the per-micro-batch reduction. Use a schedule without a split "
        "backward ('1f1b', 'gpipe', 'interleaved_1f1b'), or strategy.fsdp_memory='fast'"
    )


def _repack_with_several_stages(c: Composition) -> str:
    return (
        f"balancer.repack with strategy.stages_per_rank={c.stages_per_rank}: a consolidation plans one contiguous run "
        "of layers for each process it keeps, and schedules with several stages per rank (interleaved, zero-bubble, "
        "V) place a rank's stages apart. Set strategy.stages_per_rank=1 (schedule '1f1b' or 'gpipe'), or "
        "balancer.repack=false"
    )


def _tied_ends_on_one_process(c: Composition) -> str:
    return (
        f"balancer.min_stages={c.min_stages} with strategy.data_parallel={c.data_parallel!r}: a consolidation onto one "
        "process would put the first and the last layer, which share a parameter (tied embeddings), in one process, "
        "and FSDP2 manages a parameter in one unit only. Set balancer.min_stages=2, or untie it (dynmo-train: "
        "model.tie_embeddings=false)"
    )


def _ddp_replicas_of_split_stages(c: Composition) -> str:
    return (
        f"balancer.on_release='data_parallel' with strategy.tensor_parallel_size={c.tensor_parallel_size} under "
        "strategy.data_parallel='ddp': the released processes would become DDP replicas of stages split by tensor "
        "parallelism, and DDP cannot average parameters held as DTensor parts. Set strategy.data_parallel='replicate' "
        "(the same math over the parts) or 'fsdp'"
    )


def _wait_with_replicas_or_parts(c: Composition) -> str:
    return (
        f"balancer.on_release='wait' with strategy.data_parallel_size={c.data_parallel_size} x tensor_parallel_size="
        f"{c.tensor_parallel_size}: growing back re-admits the waiting processes as stages of the one pipeline, a "
        "process each, and does not re-form replicas or tensor-parallel groups around them. Use "
        "balancer.on_release='exit' or 'data_parallel'"
    )


def _recover_without_replicas(c: Composition) -> str:
    # A lost process's layers come from another replica (whole under ddp / replicate, FSDP2's shards from the copies
    # its replica peers keep); a tensor-parallel part has no other holder.
    return (
        "strategy.on_peer_lost='recover' takes a lost process's layers from another replica: it needs "
        "strategy.data_parallel_size >= 2 and no tensor parallelism (got "
        f"data_parallel_size={c.data_parallel_size}, tensor_parallel_size={c.tensor_parallel_size}). Use "
        "on_peer_lost='stop' with auto_resume (recovery by restart) otherwise"
    )


#: Every combination refused, in the order a job is told of the first that applies.
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        44,
        lambda c: c.tensor_parallel_size > 1 and c.data_parallel_size > 1 and c.data_parallel == "ddp",
        _tensor_parallel_under_ddp,
        Composition(data_parallel_size=2, tensor_parallel_size=2),
    ),
    Refusal(
        43,
        lambda c: c.split_backward and c.data_parallel_size > 1 and c.data_parallel == "ddp",
        _split_backward_under_ddp,
        Composition(data_parallel_size=2, schedule="zbv", split_backward=True, stages_per_rank=2),
    ),
    Refusal(
        49,
        lambda c: c.fsdp_memory != "fast" and c.data_parallel != "fsdp",
        _lean_without_fsdp,
        Composition(fsdp_memory="lean"),
    ),
    Refusal(
        49,
        lambda c: c.fsdp_memory != "fast" and c.split_backward,
        _lean_with_split_backward,
        Composition("fsdp", 2, fsdp_memory="lean", schedule="zbv", split_backward=True, stages_per_rank=2),
    ),
    Refusal(
        52,
        lambda c: c.repack and c.stages_per_rank != 1,
        _repack_with_several_stages,
        Composition(repack=True, stages_per_rank=2, schedule="interleaved_1f1b"),
    ),
    Refusal(
        51,
        lambda c: c.repack and c.data_parallel != "ddp" and c.tied_ends and c.min_stages < 2,
        _tied_ends_on_one_process,
        Composition("fsdp", 2, repack=True, tied_ends=True),
    ),
    Refusal(
        47,
        lambda c: (
            c.repack and c.on_release == "data_parallel" and c.tensor_parallel_size > 1 and c.data_parallel == "ddp"
        ),
        _ddp_replicas_of_split_stages,
        Composition(tensor_parallel_size=2, repack=True, on_release="data_parallel"),
    ),
    Refusal(
        47,
        lambda c: c.repack and c.on_release == "wait" and (c.tensor_parallel_size > 1 or c.data_parallel_size > 1),
        _wait_with_replicas_or_parts,
        Composition("fsdp", 2, repack=True, on_release="wait"),
    ),
    Refusal(
        53,
        lambda c: c.on_peer_lost == "recover" and (c.data_parallel_size < 2 or c.tensor_parallel_size > 1),
        _recover_without_replicas,
        Composition("fsdp", 2, 2, on_peer_lost="recover"),
    ),
)


def refused(composition: Composition) -> Refusal | None:
    """The first row of :data:`REFUSALS` that refuses ``composition``, or ``None`` (it composes)."""
    return next((r for r in REFUSALS if r.applies(composition)), None)


def refuse(composition: Composition) -> None:
    """Raise the first refusal of ``composition``.

    Raises:
        ValueError: a row of :data:`REFUSALS` refuses it; the message names the settings and the fix.
    """
    refusal = refused(composition)
    if refusal is not None:
        raise ValueError(refusal.message(composition))
