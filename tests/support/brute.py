"""Brute force over every split: the reference the planners are tested against, and the problems they get."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st


def compositions(n_layers: int, n_stages: int):
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        bounds = (0, *cuts, n_layers)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def blocks(values, sizes):
    start = 0
    for size in sizes:
        yield values[start : start + size]
        start += size


def block_sums(values, sizes):
    """Each block's sum as the planners compute it: a difference of float64 running sums (``balance.split.loads``).

    Summed directly, a block can land an ulp on the other side of a capacity it equals (hypothesis found one).
    """
    prefix = [0.0, *itertools.accumulate(float(v) for v in values)]
    ends = list(itertools.accumulate(sizes))
    return [prefix[end] - prefix[end - size] for end, size in zip(ends, sizes, strict=True)]


def brute_force(costs, n_stages, memory=None, capacity=None):
    """(optimal bottleneck, all optimal splits) over feasible splits, or (None, []) if none is feasible."""
    caps = capacity if isinstance(capacity, list) else [capacity] * n_stages
    scored = []
    for sizes in compositions(len(costs), n_stages):
        if memory is not None and any(sum(m) > cap for m, cap in zip(blocks(memory, sizes), caps, strict=True)):
            continue
        scored.append((max(sum(b) for b in blocks(costs, sizes)), sizes))
    if not scored:
        return None, []
    best = min(score for score, _ in scored)
    return best, [sizes for score, sizes in scored if score == best]


@st.composite
def started(draw, elements):
    """(costs, starting split) with up to 12 layers on up to 5 stages, the start drawn at random."""
    n_layers = draw(st.integers(1, 12))
    n_stages = draw(st.integers(1, min(n_layers, 5)))
    costs = draw(st.lists(elements, min_size=n_layers, max_size=n_layers))
    cuts = []
    if n_stages > 1:
        cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=n_stages - 1, max_size=n_stages - 1)))
    return costs, [b - a for a, b in itertools.pairwise([0, *cuts, n_layers])]
