"""Planning core of DynMo: which layers each pipeline stage should hold, and whether moving them pays.

Planning only: standard library and NumPy, no torch, no torch.distributed, no Lightning. Plain sequences of numbers
go in, plain lists and floats come out; carrying a plan out is the pipeline runtime's job.

Partitions are lists of layers per stage, in pipeline order: ``n_stages`` integers, each at least 1, summing to
the number of layers, stage ``i`` holding the next contiguous block. Stages and layers are numbered from 0
(also in error messages).

* :func:`partition` - ``partition(costs, n_stages, *, method="optimal", memory=None, capacity=None)``, with
  methods :data:`METHODS`: ``"optimal"`` (exact minimum bottleneck, optionally under per-stage memory capacities),
  ``"uniform"`` (by layer count), ``"params"`` (optimal split of parameter counts, the DeepSpeed baseline done
  exactly), ``"static_time"`` (optimal split of times profiled once, the torchgpipe baseline) and ``"diffusion"``
  (decentralised neighbour-only protocol from the uniform split; it ends on an optimal split).
* :func:`diffuse` - the diffusion protocol from any starting split, all stages simulated in one process, in mode
  ``"exact"`` (:mod:`~dynmo_lightning.balance.diffusion.exact_mode`: a bound search by push and pull settles, ending on
  the optimal split) or ``"sweep"`` (:mod:`~dynmo_lightning.balance.diffusion.sweep_mode`: one prefix scan and
  equal-share cuts, bottleneck below the optimum plus the largest layer cost, about ``2 P`` rounds);
  :class:`DiffusionResult` reports the split, rounds used, bottleneck and whether it finished within ``max_rounds``. One
  stage of it is :class:`~dynmo_lightning.balance.diffusion.driver.DiffusionStage`
  (:mod:`~dynmo_lightning.balance.diffusion.driver`, with the in-memory drivers), the state machine the runtime drives
  point-to-point (:mod:`dynmo_lightning.pipeline.stage.neighbours`); it dispatches to its mode's object. Both modes
  share the card and the outcome (:mod:`~dynmo_lightning.balance.diffusion.cards`) and a stage's own state
  (:mod:`~dynmo_lightning.balance.diffusion.stage_state`).
* :func:`bottleneck`, :func:`stage_loads`, :func:`imbalance`, :func:`bytes_moved`, :func:`validate_partition` -
  measure and check partitions.
* :class:`InfeasibleMemoryError` (a ``ValueError``) - no split fits the capacities; the message says why.
* :func:`plan_repack` - the fewest stages within a tolerance of the current step time, and which ranks keep
  running so that the fewest bytes move (:class:`RepackPlan`).
* :class:`BalancePolicy` (:mod:`~dynmo_lightning.balance.decision.policy`) - THE decision (keep / migrate / repack) with
  its cadence and cost tracker, driven by the runtime balancer and replayed by the simulator alike.
* Step-time model (:mod:`~dynmo_lightning.balance.steptime.makespan`): :func:`makespan` - the makespan of torch 2.13's
  task order for ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zb"``, ``"zbv"`` and ``"dualpipev"``
  over per-stage forward, backward and backward-weight times, p2p hops and the stage-to-rank placement
  (:mod:`~dynmo_lightning.balance.split.placement`); an ``O(P M)`` event engine, the one the simulator runs too.
* :func:`makespan_split`, :class:`StepModel` (:mod:`~dynmo_lightning.balance.steptime.planner`) - the makespan-optimal
  split within memory caps, what every decision plans for.
* Memory (:mod:`~dynmo_lightning.balance.steptime.memory_model`): :class:`MemoryModel` - every rank's peak under the
  schedule's own task order (weights, gradients, optimizer state, in-flight activations, receive buffers, weight copies,
  the backward's transient) and during a migration; :class:`MemoryCheck` - what plans, moves and repacks must fit.
* Closed form (:mod:`~dynmo_lightning.balance.steptime.closed_form`): :func:`stage_times`, :func:`step_time`,
  :func:`bubble_fraction`, :func:`should_repartition` - the fill/drain estimate of GPipe/1F1B (exact only where its
  module says), and whether a re-partition saves more than the migration costs.

Invalid arguments raise ``ValueError`` with a message naming the bad value and how to fix it.
"""

from dynmo_lightning.balance.decision.policy import BalancePolicy, Decision, PipelineShape
from dynmo_lightning.balance.decision.repack import RepackPlan, plan_repack
from dynmo_lightning.balance.decision.tracker import CostTracker
from dynmo_lightning.balance.diffusion.driver import DiffusionResult, diffuse
from dynmo_lightning.balance.partitioning.methods import METHODS, partition
from dynmo_lightning.balance.split.fit import InfeasibleMemoryError
from dynmo_lightning.balance.split.loads import (
    bottleneck,
    bytes_moved,
    imbalance,
    layer_owners,
    stage_loads,
    validate_partition,
)
from dynmo_lightning.balance.steptime.closed_form import bubble_fraction, should_repartition, stage_times, step_time
from dynmo_lightning.balance.steptime.makespan import makespan
from dynmo_lightning.balance.steptime.memory_model import LayerBytes, MemoryCheck, MemoryModel
from dynmo_lightning.balance.steptime.planner import StepModel, makespan_split

__all__ = [
    "METHODS",
    "BalancePolicy",
    "CostTracker",
    "Decision",
    "DiffusionResult",
    "InfeasibleMemoryError",
    "LayerBytes",
    "MemoryCheck",
    "MemoryModel",
    "PipelineShape",
    "RepackPlan",
    "StepModel",
    "bottleneck",
    "bubble_fraction",
    "bytes_moved",
    "diffuse",
    "imbalance",
    "layer_owners",
    "makespan",
    "makespan_split",
    "partition",
    "plan_repack",
    "should_repartition",
    "stage_loads",
    "stage_times",
    "step_time",
    "validate_partition",
]
