"""Partitions as layers-per-stage lists: checking them and measuring their stage loads."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from dynmo_lightning.balance.split.checks import as_values
from dynmo_lightning.balance.split.placement import stage_ranks


def prefix_sums(values: np.ndarray) -> np.ndarray:
    """Compute running totals with a leading zero, so a block ``[start, end)`` sums to ``out[end] - out[start]``.

    Args:
        values: per-layer numbers.

    Returns:
        Float64 array of length ``len(values) + 1``.

    """
    out = np.zeros(values.size + 1)
    np.cumsum(values, out=out[1:])
    return out


def validate_partition(layers_per_stage: Sequence[int], n_layers: int, n_stages: int | None = None) -> list[int]:
    """Check that a layers-per-stage list describes a valid contiguous split.

    Args:
        layers_per_stage: layers held by each stage, in pipeline order.
        n_layers: layers in the model; the entries must sum to it.
        n_stages: expected number of stages, or ``None`` to accept any.

    Returns:
        The partition as a list of plain ``int``.

    Raises:
        ValueError: if an entry is not an integer or is below 1, if the number of stages differs from ``n_stages``,
            or if the entries do not sum to ``n_layers``.

    """
    sizes = list(layers_per_stage)
    out: list[int] = []
    for stage, size in enumerate(sizes):
        if isinstance(size, bool):
            raise ValueError(f"partition {sizes} has {size!r} for stage {stage}: entries must be integer layer counts")
        try:
            out.append(operator.index(size))
        except TypeError:
            raise ValueError(
                f"partition {sizes} has {size!r} for stage {stage}: entries must be integer layer counts"
            ) from None
    if n_stages is not None and len(out) != n_stages:
        raise ValueError(f"partition {out} has {len(out)} stages but there are {n_stages}; give one entry per stage")
    for stage, size in enumerate(out):
        if size < 1:
            raise ValueError(f"partition {out} gives stage {stage} {size} layers; every stage needs at least one layer")
    if sum(out) != n_layers:
        raise ValueError(
            f"partition {out} sums to {sum(out)} but the model has {n_layers} layers; "
            f"give one entry per stage summing to {n_layers}"
        )
    return out


def stage_loads(costs: Sequence[float], layers_per_stage: Sequence[int]) -> list[float]:
    """Sum of the layer costs each stage holds.

    Sums are differences of float64 prefix sums, the same arithmetic the optimal planner uses, so
    ``bottleneck(costs, partition(costs, n))`` is exactly the minimum the planner certifies.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: a valid partition of those layers.

    Returns:
        One load per stage.

    Raises:
        ValueError: if the costs are invalid or the partition does not fit them.

    """
    values = as_values(costs, "costs")
    sizes = validate_partition(layers_per_stage, values.size)
    prefix = prefix_sums(values)
    ends = np.cumsum(sizes)
    return (prefix[ends] - prefix[ends - sizes]).tolist()


def bottleneck(costs: Sequence[float], layers_per_stage: Sequence[int]) -> float:
    """Largest stage load: the stage that sets the pipeline's pace.

    Args:
        costs: cost of each layer, in model order.
        layers_per_stage: a valid partition of those layers.

    Returns:
        The maximum over stages of the sum of the stage's layer costs.

    Raises:
        ValueError: if the costs are invalid or the partition does not fit them.

    """
    return max(stage_loads(costs, layers_per_stage))


def imbalance(loads: Sequence[float]) -> float:
    """Largest stage load over the mean load: 1 is a perfect balance, ``P`` all the work on one of ``P`` stages.

    Args:
        loads: one load per stage (e.g. :func:`stage_loads`).

    Returns:
        ``max / mean``, or 1 when every stage is idle.
    """
    mean = math.fsum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def layer_owners(layers_per_stage: Sequence[int], n_ranks: int | None = None, schedule: str = "1f1b") -> list[int]:
    """The rank holding each layer, stages placed by :func:`~dynmo_lightning.balance.split.placement.stage_ranks`.

    Args:
        layers_per_stage: a partition.
        n_ranks: ranks of the pipeline (fewer than the stages when each rank runs several stages; default: one
            stage per rank).
        schedule: the schedule, which places the stages (a loop, or the V of ``"zbv"``/``"dualpipev"``).

    Returns:
        One rank per layer.
    """
    ranks = n_ranks or len(layers_per_stage)
    placed = stage_ranks(schedule, ranks, len(layers_per_stage) // ranks)
    return [placed[stage] for stage, n in enumerate(layers_per_stage) for _ in range(n)]


def bytes_moved(
    current: Sequence[int],
    proposed: Sequence[int],
    layer_bytes: Sequence[float],
    n_ranks: int | None = None,
    schedule: str = "1f1b",
) -> float:
    """Bytes of the layers that change rank when the split ``current`` becomes ``proposed`` over the same ranks.

    Args:
        current: the partition now.
        proposed: the partition after the move.
        layer_bytes: what moves with each layer (parameters plus optimizer state).
        n_ranks: ranks of the pipeline (see :func:`layer_owners`).
        schedule: the schedule, which places the stages (see :func:`layer_owners`).

    Returns:
        The sum of ``layer_bytes`` over the layers whose owner changes.
    """
    now, new = layer_owners(current, n_ranks, schedule), layer_owners(proposed, n_ranks, schedule)
    return math.fsum(b for b, x, y in zip(layer_bytes, now, new, strict=True) if x != y)
