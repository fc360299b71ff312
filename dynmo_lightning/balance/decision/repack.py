"""Repack planner: the fewest pipeline stages that keep the step time, and which ranks to keep.

When dynamic techniques shrink the work (frozen layers cost only their forward, pruned layers shrink, exited tokens
skip layers), the same step time can often be had on fewer workers: fewer stages also mean a shorter pipeline fill
and drain and fewer hops. :func:`plan_repack` finds the smallest stage count ``P'`` whose makespan-optimal split
(:func:`~dynmo_lightning.balance.steptime.planner.makespan_split`: the schedule's own task order, simulated) is within
``tolerance`` of the best makespan (the makespan-optimal split over ``reference_stages``, the pipeline's full size;
the current split's makespan when not given) and fits in memory, and chooses which of the current ranks keep
running so that the fewest bytes move. A stage count whose bound ``M * (its least bottleneck)`` already misses the
bar is never simulated.

Rank choice: new stage ``s`` runs on kept rank ``r_s``, with ``r_0 = 0`` (rank 0 logs and checkpoints, it is never
released) and ``r_0 < r_1 < ...`` (the kept ranks keep their order, so the new process group numbers them the same
way). Among such monotone assignments a dynamic programme over (stage, rank) picks the one that leaves the most
bytes where they are: ``kept[s][r]`` is the bytes of the new stage ``s``'s layers that rank ``r`` already holds, and
``best[s][r] = kept[s][r] + max over r' < r of best[s - 1][r']``.

Whole nodes: a scheduler can take back a node only when nothing of the job runs on it any more, so a released rank
on a node that still runs a stage frees nothing for it. Given each rank's node, the kept ranks are chosen first to
free the most whole nodes (they fill the fewest nodes, rank 0's node always among them), then to move the fewest
bytes among those node sets. The node sets are enumerated exactly up to :data:`MAX_NODE_SETS` candidates; beyond
that the fullest nodes are taken (a greedy choice that still frees the most nodes, maybe moving more bytes).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence

from dynmo_lightning.balance.partitioning.methods import partition
from dynmo_lightning.balance.split.loads import bottleneck, validate_partition
from dynmo_lightning.balance.steptime.planner import StepModel, makespan_split

#: Node sets tried exactly when choosing which nodes keep running (beyond: the fullest nodes, greedily).
MAX_NODE_SETS = 4096


@dataclasses.dataclass(frozen=True)
class RepackPlan:
    """A consolidation: ``layers_per_stage`` on the current ranks ``keep_ranks`` (in order); the others go."""

    layers_per_stage: list[int]
    keep_ranks: list[int]
    step_time: float
    current_step_time: float
    bytes_moved: float
    freed_nodes: list[Hashable] = dataclasses.field(default_factory=list)

    @property
    def n_stages(self) -> int:
        """Stages after the repack."""
        return len(self.layers_per_stage)


def plan_repack(
    fwd: Sequence[float],
    bwd: Sequence[float],
    current: Sequence[int],
    *,
    n_microbatches: int,
    schedule: str = "1f1b",
    p2p: float = 0.0,
    wgt: Sequence[float] | None = None,
    tolerance: float = 0.05,
    min_stages: int = 1,
    layer_bytes: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
    nodes: Sequence[Hashable] | None = None,
    reference_stages: int | None = None,
    model: StepModel | None = None,
    speeds: Sequence[float] | None = None,
) -> RepackPlan | None:
    """The smallest consolidation predicted within ``tolerance`` of the current step time, or ``None``.

    Args:
        fwd: forward time of each layer for one micro-batch.
        bwd: backward time of each layer for one micro-batch.
        current: layers per stage now (one stage per rank).
        n_microbatches: micro-batches per step.
        schedule: a schedule with one stage per rank (``"gpipe"``, ``"1f1b"``).
        p2p: one-hop transfer time.
        wgt: weight-gradient part of each layer's backward (zero-bubble schedules); ``None``: 0.
        tolerance: accepted relative slow-down of the makespan, ``>= 0`` (0.05: at most 5 % slower).
        min_stages: never plan fewer stages than this.
        layer_bytes: bytes that move with each layer (parameters, optimizer state); 1 per layer when omitted.
        memory: memory each layer needs on its stage (with ``capacity``); the new stages must fit.
        capacity: memory a stage may hold (one number for every stage).
        nodes: the node each current rank runs on (any hashable: a host name, a node rank); when given, the kept
            ranks free the most whole nodes (see the module docstring).
        reference_stages: the tolerance is relative to the optimal split over this many stages (the job's full
            pipeline): consolidations one after another then never add up to more than ``tolerance`` (relative to
            the current step time, each would allow ``tolerance`` more). ``None``: relative to the current step time.
        model: the step model of these costs and timing, to reuse its memoised makespans (made here when omitted).
        speeds: each current rank's relative speed (``None``: all alike). The kept ranks are then the fastest ones
            (rank 0 always among them; with ``nodes``, the fastest of the fewest whole nodes), each new stage's
            time is its costs over its rank's speed, and the release names the slowest processes: a straggler is
            what a consolidation gives back first (see :func:`_plan_with_speeds`).

    Returns:
        The plan with the fewest stages (fewer than now), or ``None`` when no smaller pipeline is fast enough.

    Raises:
        ValueError: for a negative tolerance, ``min_stages < 1`` or an invalid current split.
    """
    _check_settings(tolerance, min_stages)
    n_layers = len(fwd)
    current = validate_partition(current, n_layers)
    if layer_bytes is None:
        layer_bytes = [1.0] * n_layers
    if nodes is not None and len(nodes) != len(current):
        raise ValueError(f"nodes has {len(nodes)} entries for {len(current)} ranks: give one node per rank")
    if model is None:
        model = StepModel(fwd, bwd, n_microbatches, schedule, p2p, wgt=wgt)
    if speeds is not None and len(set(speeds)) > 1:
        return _plan_with_speeds(model, current, _per_rank(speeds, current), tolerance, min_stages, layer_bytes,
                                 memory, capacity, nodes, reference_stages)  # fmt: skip
    now = model(current)
    bar = (1 + tolerance) * now
    if reference_stages is not None:
        reference = best_split(model, max(1, min(reference_stages, n_layers)))
        assert reference is not None  # no memory limit: every stage count up to the layers is feasible
        bar = (1 + tolerance) * reference[0]
    for n_stages in range(min_stages, len(current)):
        # No split of n_stages beats M times its least bottleneck: skip the stage counts that bound rules out.
        if n_microbatches * bottleneck(model.costs, partition(model.costs, n_stages)) > bar:
            continue
        best = best_split(model, n_stages, memory=memory, capacity=capacity)
        if best is None:
            continue
        predicted, proposed = best
        if predicted <= bar:
            return _plan_on_ranks(current, proposed, layer_bytes, nodes, predicted, now)
    return None


def _per_rank(speeds: Sequence[float], current: Sequence[int]) -> list[float]:
    if len(speeds) != len(current):
        raise ValueError(f"speeds has {len(speeds)} entries for {len(current)} ranks: give one speed per rank")
    return [float(v) for v in speeds]


def _plan_with_speeds(
    model: StepModel,
    current: list[int],
    speeds: list[float],
    tolerance: float,
    min_stages: int,
    layer_bytes: Sequence[float],
    memory: Sequence[float] | None,
    capacity: float | Sequence[float] | None,
    nodes: Sequence[Hashable] | None,
    reference_stages: int | None,
) -> RepackPlan | None:
    """:func:`plan_repack` on ranks of different speeds: for each stage count, the fastest ranks that can run it.

    Which ranks: rank 0 and the fastest others (with ``nodes``: of each candidate set of the fewest whole nodes, the
    fastest ranks on them, and the set whose split is fastest); the split is planned for their speeds. A stage count
    is taken when its makespan is within ``tolerance`` of the reference, as without speeds; among equally fast rank
    sets the one that moves the fewest bytes.
    """
    model = model.with_speeds(speeds)
    now = model(current)
    bar = (1 + tolerance) * now
    if reference_stages is not None:
        n_ref = max(1, min(reference_stages, model.n_layers))
        reference = best_split(model.for_ranks(n_ref), n_ref)
        assert reference is not None  # no memory limit: every stage count up to the layers is feasible
        bar = (1 + tolerance) * reference[0]
    for n_stages in range(min_stages, len(current)):
        found: tuple[float, float, list[int], list[int]] | None = None
        for keep in _fastest_ranks(speeds, n_stages, nodes):
            best = best_split(model.with_speeds([speeds[r] for r in keep]), n_stages, memory=memory,
                              capacity=capacity)  # fmt: skip
            if best is None or best[0] > bar:
                continue
            _, moved = _keep_ranks(current, best[1], layer_bytes, set(keep))
            if found is None or (best[0], moved) < found[:2]:
                found = (best[0], moved, best[1], keep)
        if found is not None:
            predicted, moved, proposed, keep = found
            freed = [] if nodes is None else list(dict.fromkeys(n for n in nodes if n not in {nodes[r] for r in keep}))
            return RepackPlan(proposed, keep, predicted, now, moved, freed)
    return None


def _fastest_ranks(speeds: list[float], n_keep: int, nodes: Sequence[Hashable] | None) -> list[list[int]]:
    """Candidate rank sets (ascending, rank 0 first) of ``n_keep`` ranks: the fastest, on the fewest whole nodes."""

    def fastest(allowed: Sequence[int]) -> list[int]:
        others = sorted((r for r in allowed if r != 0), key=lambda r: (-speeds[r], r))
        return sorted([0, *others[: n_keep - 1]])

    if nodes is None:
        return [fastest(range(len(speeds)))]
    ranks_on: dict[Hashable, list[int]] = {}
    for r, node in enumerate(nodes):
        ranks_on.setdefault(node, []).append(r)
    home, others = nodes[0], [n for n in ranks_on if n != nodes[0]]
    for k in range(len(others) + 1):  # the fewest nodes that hold enough ranks, rank 0's among them
        sets = [c for c in itertools.islice(itertools.combinations(others, k), MAX_NODE_SETS)
                if len(ranks_on[home]) + sum(len(ranks_on[n]) for n in c) >= n_keep]  # fmt: skip
        if sets:
            candidates = {tuple(fastest([r for n in (home, *c) for r in ranks_on[n]])) for c in sets}
            return [list(c) for c in sorted(candidates)]
    return [fastest(range(len(speeds)))]


def _check_settings(tolerance: float, min_stages: int) -> None:
    """Raise ``ValueError`` for a negative ``tolerance`` or ``min_stages < 1``."""
    if tolerance < 0:
        raise ValueError(f"balancer.repack_tolerance={tolerance} must be >= 0")
    if min_stages < 1:
        raise ValueError(f"balancer.min_stages={min_stages} must be >= 1")


def _plan_on_ranks(
    current: list[int],
    proposed: list[int],
    layer_bytes: Sequence[float],
    nodes: Sequence[Hashable] | None,
    predicted: float,
    now: float,
) -> RepackPlan:
    """The plan for split ``proposed``: which current ranks keep running it, and (with ``nodes``) the nodes freed.

    Args:
        current: layers per stage now (one stage per rank).
        proposed: layers per stage of the smaller pipeline.
        layer_bytes: bytes that move with each layer.
        nodes: the node each current rank runs on, or ``None``.
        predicted: the makespan of ``proposed``.
        now: the makespan of ``current``.
    """
    if nodes is None:
        keep, moved = _keep_ranks(current, proposed, layer_bytes)
        return RepackPlan(proposed, keep, predicted, now, moved)
    keep, moved = _keep_ranks_on_nodes(current, proposed, layer_bytes, list(nodes))
    # A node is freed only when none of the kept ranks runs on it (in the order the nodes first appear).
    freed = list(dict.fromkeys(n for n in nodes if n not in {nodes[r] for r in keep}))
    return RepackPlan(proposed, keep, predicted, now, moved, freed)


def best_split(
    model: StepModel,
    n_stages: int,
    *,
    memory: Sequence[float] | None = None,
    capacity: float | Sequence[float] | None = None,
) -> tuple[float, list[int]] | None:
    """The makespan-optimal split over ``n_stages`` and its makespan, or ``None`` when nothing fits in memory."""
    return makespan_split(model, n_stages, memory=memory, capacity=capacity)


def _keep_ranks_on_nodes(
    current: list[int], proposed: list[int], layer_bytes: Sequence[float], nodes: list[Hashable]
) -> tuple[list[int], float]:
    """:func:`_keep_ranks` on the fewest whole nodes (rank 0's among them), the fewest bytes moved among those."""
    ranks_on: dict[Hashable, list[int]] = {}
    for r, node in enumerate(nodes):
        ranks_on.setdefault(node, []).append(r)
    home, need = nodes[0], len(proposed)
    others = sorted((n for n in ranks_on if n != home), key=lambda n: -len(ranks_on[n]))
    # The fewest nodes that hold enough ranks: rank 0's node plus the fullest others.
    k, have = 0, len(ranks_on[home])
    while have < need:
        have += len(ranks_on[others[k]])
        k += 1
    if math.comb(len(others), k) <= MAX_NODE_SETS:
        candidates = [
            c
            for c in itertools.combinations(others, k)
            if sum(len(ranks_on[n]) for n in c) >= need - len(ranks_on[home])
        ]
    else:
        candidates = [tuple(others[:k])]
    best: tuple[list[int], float] | None = None
    for chosen in candidates:
        allowed = {r for n in (home, *chosen) for r in ranks_on[n]}
        keep, moved = _keep_ranks(current, proposed, layer_bytes, allowed)
        if best is None or moved < best[1]:
            best = (keep, moved)
    assert best is not None
    return best


def _keep_ranks(
    current: list[int], proposed: list[int], layer_bytes: Sequence[float], allowed: set[int] | None = None
) -> tuple[list[int], float]:
    """Monotone assignment of new stages to current ranks (stage 0 on rank 0) that moves the fewest bytes.

    Only ranks in ``allowed`` (every rank when ``None``) may be kept; rank 0 always is.
    """
    owner = [r for r, n in enumerate(current) for _ in range(n)]
    n_ranks, n_new = len(current), len(proposed)
    kept = [[0.0] * n_ranks for _ in range(n_new)]
    start = 0
    for s, n in enumerate(proposed):
        for i in range(start, start + n):
            kept[s][owner[i]] += layer_bytes[i]
        start += n
    neg = float("-inf")
    best = [[neg] * n_ranks for _ in range(n_new)]
    came = [[-1] * n_ranks for _ in range(n_new)]
    best[0][0] = kept[0][0]
    for s in range(1, n_new):
        run, arg = neg, -1
        for r in range(1, n_ranks):
            if best[s - 1][r - 1] > run:
                run, arg = best[s - 1][r - 1], r - 1
            if run > neg and (allowed is None or r in allowed):
                best[s][r], came[s][r] = run + kept[s][r], arg
    r = max(range(n_ranks), key=lambda q: (best[-1][q], -q))
    ranks = [r]
    for s in range(n_new - 1, 0, -1):
        r = came[s][r]
        ranks.append(r)
    ranks.reverse()
    return ranks, float(sum(layer_bytes)) - best[-1][ranks[-1]]
