"""Argument checks shared by the planners and the cost model; every error names the bad entry and the fix."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np


def fmt(value: float) -> str:
    """Format a number for an error message.

    Args:
        value: the number.

    Returns:
        Up to six significant digits, so messages stay short for arbitrary floats.

    """
    return f"{float(value):.6g}"


def as_values(values: Sequence[float], name: str) -> np.ndarray:
    """Convert per-layer (or per-stage) numbers to a float array and check them.

    Args:
        values: the numbers, e.g. layer costs.
        name: what they are, used in error messages (``"costs"``, ``"memory"``, ...).

    Returns:
        A 1-D float64 array.

    Raises:
        ValueError: if an entry is not a number, is negative, NaN or infinite, or if the entries sum to infinity.

    """
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a sequence of numbers: {err}") from None
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of numbers, got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {array[i]} is not allowed: every entry of {name} must be finite and >= 0")
    # Prefix sums must stay finite, or every block containing the overflow compares equal.
    with np.errstate(over="ignore"):
        total = float(np.sum(array))
    if not math.isfinite(total):
        raise ValueError(f"{name} sum to infinity in float64; rescale them (e.g. milliseconds instead of seconds)")
    return array


def as_stage_count(n_stages: int, n_layers: int) -> int:
    """Check a number of pipeline stages against the number of layers.

    Args:
        n_stages: requested stages.
        n_layers: layers in the model.

    Returns:
        ``n_stages`` as an ``int``.

    Raises:
        ValueError: if ``n_stages`` is not an integer, is below 1, or exceeds ``n_layers``.

    """
    if isinstance(n_stages, bool):
        raise ValueError(f"n_stages must be an integer, got {n_stages!r}")
    try:
        count = operator.index(n_stages)
    except TypeError:
        raise ValueError(f"n_stages must be an integer, got {n_stages!r}") from None
    if count < 1:
        raise ValueError(f"n_stages={count} but a pipeline needs at least one stage; use n_stages >= 1")
    if count > n_layers:
        raise ValueError(
            f"n_stages={count} > {n_layers} layers: every stage needs at least one layer; "
            "use fewer stages or a model with more layers"
        )
    return count


def as_capacities(
    memory: Sequence[float] | None,
    capacity: float | Sequence[float] | None,
    n_layers: int,
    n_stages: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Check a per-layer memory profile and the per-stage memory capacity that goes with it.

    Args:
        memory: memory each layer needs, or ``None``.
        capacity: memory each stage may hold: one number for every stage or one per stage, or ``None``.
        n_layers: layers in the model.
        n_stages: pipeline stages.

    Returns:
        ``None`` when neither is given, else ``(memory, capacities)`` as float arrays of length ``n_layers`` and
        ``n_stages``.

    Raises:
        ValueError: if only one of the two is given, if a length is wrong, or if an entry is negative or not a
            number (``inf`` is allowed as a capacity and means unlimited).

    """
    if memory is None and capacity is None:
        return None
    if memory is None:
        raise ValueError("capacity was given without memory: pass memory=[per-layer memory] too, or neither")
    if capacity is None:
        raise ValueError("memory was given without capacity: pass capacity=<per-stage limit> too, or neither")
    mem = as_values(memory, "memory")
    if mem.size != n_layers:
        raise ValueError(f"memory has {mem.size} entries but costs has {n_layers}: give one memory value per layer")
    caps = np.asarray(capacity, dtype=np.float64)
    if caps.ndim == 0:
        caps = np.full(n_stages, float(caps))
    elif caps.ndim != 1 or caps.size != n_stages:
        raise ValueError(
            f"capacity has {caps.size} entries but there are {n_stages} stages: give one number for all stages "
            "or one per stage"
        )
    bad = np.flatnonzero(np.isnan(caps) | (caps < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"capacity of stage {i} is {caps[i]}: capacities must be >= 0 (inf means unlimited)")
    return mem, caps


def as_speeds(speeds: Sequence[float], n_stages: int) -> np.ndarray:
    """Check per-stage speeds (the relative speed of the process running each stage).

    Raises:
        ValueError: not one per stage, or an entry that is not a finite number above 0.
    """
    rates = np.asarray(speeds, dtype=np.float64)
    if rates.ndim != 1 or rates.size != n_stages:
        raise ValueError(f"speeds has {rates.size} entries for {n_stages} stages: give one speed per stage")
    bad = np.flatnonzero(~np.isfinite(rates) | (rates <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"speed of stage {i} is {rates[i]}: speeds must be finite and > 0 (1: the reference)")
    return rates
