"""What planning a split costs in messages: diffusion between neighbours vs gather-and-plan, per message latency.

A latency/bandwidth model (each message costs ``latency + bytes / bandwidth``), fed with the protocol's real round
count (from :func:`~dynmo_lightning.balance.diffuse`, the same stage code the runtime drives) and measured compute,
so that the decentralised and the centralised planner can be compared at stage counts no test machine has.
"""

from __future__ import annotations

import math


def _hops(n_stages: int) -> int:
    return math.ceil(math.log2(n_stages)) if n_stages > 1 else 0


def neighbour_plan_time(
    rounds: int, card_bytes: int, n_stages: int, *, latency: float, bandwidth: float, compute_s: float = 0.0
) -> float:
    """Seconds the diffusion protocol takes between neighbours.

    Every round a stage sends its card to both neighbours and waits for theirs (the two directions overlap): one
    latency plus one card's transfer per round. Then the one collective, the termination check (a scalar
    all-reduce: ``2 ceil(log2 P)`` latencies).

    Args:
        rounds: synchronous rounds of the protocol.
        card_bytes: bytes of one card.
        n_stages: stages of the pipeline.
        latency: seconds of one message, however small.
        bandwidth: bytes per second of a link.
        compute_s: one stage's own work over all rounds.
    """
    return rounds * (latency + card_bytes / bandwidth) + 2 * _hops(n_stages) * latency + compute_s


def gather_plan_time(
    n_layers: int,
    n_stages: int,
    layer_bytes: int,
    *,
    latency: float,
    bandwidth: float,
    plan_s: float,
    ring: bool = False,
) -> float:
    """Seconds the centralised planner takes: all-gather every layer's numbers, then plan (on every process).

    The all-gather is counted at its best (recursive doubling): ``ceil(log2 P)`` message latencies, and each
    process receives the ``(P - 1) / P`` share of the data it lacks. With ``ring``, as a ring all-gather (what
    gloo's and NCCL's ``all_gather`` run): ``P - 1`` latencies, the same bytes.

    Args:
        n_layers: layers of the model.
        n_stages: stages of the pipeline.
        layer_bytes: bytes of one layer's numbers (cost, memory, forward, backward, bytes to move).
        latency: seconds of one message.
        bandwidth: bytes per second of a link.
        plan_s: measured time of the central planner (``partition(..., method="optimal")``).
        ring: price the all-gather as a ring instead of recursive doubling.
    """
    data = n_layers * layer_bytes * (n_stages - 1) / n_stages
    hops = n_stages - 1 if ring else _hops(n_stages)
    return hops * latency + data / bandwidth + plan_s
