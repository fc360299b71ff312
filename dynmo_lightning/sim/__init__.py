"""Discrete-event pipeline simulator: what a split costs when every task is played out, step by step.

Pure Python and NumPy: no torch, no Lightning. It answers questions the real runtime cannot afford on a 2-core
machine (more than a few stages, hundreds of steps, policy A/B at scale) and cross-checks the analytic model.

* :func:`simulate` - one training step for every schedule of :data:`dynmo_lightning.balance.steptime.makespan.SCHEDULES`
  (torch 2.13's task orders: GPipe, 1F1B, interleaved 1F1B and zero-bubble, ZBV, DualPipeV), through the event
  engine of :mod:`dynmo_lightning.balance.steptime.makespan` - the same code every balancing decision uses. Each rank
  runs its stages' tasks in its schedule's order, one at a time; a forward needs the previous stage's forward of that
  micro-batch plus ``p2p``, a backward the next stage's backward plus ``p2p`` (free between stages on one rank). Stage
  times may differ per stage and, as ``[P][M]`` arrays, per micro-batch. :class:`SimResult` has the makespan, busy
  times, bubble fraction and the full :class:`Task` timeline.
* :func:`simulate_layers` - per-layer costs plus a partition; stage sums come from :func:`balance.stage_times`.
* :func:`simulate_run` - replays a cost trace (:func:`load_trace` reads the profiler's ``costs.jsonl``) under a
  policy of :data:`POLICIES`, migrating and consolidating as the balancer would; :class:`RunResult`.
* :func:`neighbour_plan_time`, :func:`gather_plan_time` - what planning costs in messages at a given latency: the
  diffusion protocol's rounds between neighbours vs the centralised all-gather of every layer's costs plus planning.

This package holds no cost model, engine or planner of its own: stage sums, the event engine and task orders,
partitions, diffusion, the re-partition rule and the repack planner are all :mod:`dynmo_lightning.balance`'s.

Agreement with the closed form :func:`balance.step_time` (pinned down by ``tests/sim/test_sim_closed_form.py``):
GPipe matches it exactly for per-stage constant times, heterogeneous stages and any ``p2p``. Both schedules never
go below ``max_s [sum_{j<s}(f_j + b_j) + 2 s p2p + M (f_s + b_s)]``. 1F1B matches the closed form with equal stages
and ``p2p = 0``; with heterogeneous stages and ``p2p = 0`` it was never slower than GPipe on random cases, but falls
on either side of the closed form (0.78x to 1.11x of it seen): a bottleneck on the first stage hides the others'
fill, while forward and backward bottlenecks on different stages stall the warm-up. With ``p2p > 0`` 1F1B cannot
hide the hops (stage ``s`` holds at most ``P - s`` micro-batches in flight): equal stages take
``(M + P - 1)(f + b) + 2 (P - 1) p2p + 2 p2p floor((M - 1)(P - 1) / P)``, more than the closed form.
"""

from dynmo_lightning.sim.planning import gather_plan_time, neighbour_plan_time
from dynmo_lightning.sim.replay import POLICIES, RunResult, simulate_run
from dynmo_lightning.sim.simulator import SimResult, Task, schedule_order, simulate, simulate_layers
from dynmo_lightning.sim.traces import check_trace, load_trace, save_trace

__all__ = [
    "POLICIES",
    "RunResult",
    "SimResult",
    "Task",
    "check_trace",
    "gather_plan_time",
    "load_trace",
    "neighbour_plan_time",
    "save_trace",
    "schedule_order",
    "simulate",
    "simulate_layers",
    "simulate_run",
]
