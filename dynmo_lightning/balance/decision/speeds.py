"""Every pipeline process's relative speed: a slow device is imbalance too.

A pipeline runs at the pace of its slowest process, whatever makes it slow: a layer that got more expensive or a
device that got slower (thermal throttling, a noisy neighbour, a degraded host, an older GPU). Measured layer times
confound the two: a slow process makes its own layers look expensive, and that cost would travel with a layer to a
fast process. So the costs the policy plans from are *normalised* to a reference speed, and the planner divides each
stage's cost by the speed of the process that runs it (:class:`~dynmo_lightning.balance.steptime.planner.StepModel`).

How a speed is measured: whenever a step is profiled, every process also times a fixed calibration kernel (a few
small matrix products, :func:`~dynmo_lightning.profiling.calibration_seconds`), and each measured layer carries the
kernel's time on its process (``probe_s``) and the process's pipeline rank (``pp_rank``). The fastest process of the
step is the reference (speed 1); a process whose kernel took twice as long has speed 0.5. Why a kernel rather than
layer times compared across processes that held the same layer: those comparisons need a layer to move (or layers to
be alike), and a dynamic that changes costs while a process slows down (freezing, pruning, exits) makes them disagree
for reasons that are not speed; the kernel's cost never changes, so its time is the process's speed alone. What it
does not see: a slow *link* (it times compute), and a slowdown of kernels unlike it (a memory-bound slowdown shows
less in a compute-bound kernel); both still show up as step time, not as a speed.

Smoothing: a process's speed is the median of its last ``window`` kernel ratios (one noisy step moves nothing), and
the speeds in force change only when some estimate leaves a band of ``tolerance`` around the speed in force
(hysteresis: a straggler is followed, noise is not). A change in force is an event: the policy checks at once
(:meth:`~dynmo_lightning.balance.decision.cadence.PolicyCadence.observe`). Each step's layer times are normalised
with that step's own kernel ratios (same conditions, no smoothing lag), so the tracked costs stay speed-free while
speeds come and go.

With replicas (data-parallel pipelines) every replica runs the same partition, and the gradient sync makes all of
them wait for the slowest: a stage's speed is its slowest replica's (the gathering takes the largest kernel time),
and its costs are the replicas' normalised costs averaged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

#: The measured time fields of a layer (normalised to the reference speed); the rest are bytes and bookkeeping.
TIME_FIELDS = ("fwd", "bwd", "bwd_weight")


class ProcessSpeeds:
    """Smoothed relative speed of every pipeline rank, with hysteresis, and the normalisation of measured times.

    Args:
        tolerance: relative change of a rank's estimate that changes the speeds in force (0.1: 10 %).
        window: kernel measurements per rank whose median is the estimate.
    """

    def __init__(self, tolerance: float = 0.1, window: int = 3) -> None:
        if tolerance < 0:
            raise ValueError(f"balancer.speed_tolerance={tolerance} must be >= 0")
        self.tolerance = tolerance
        self.window = window
        #: Speed in force of each pipeline rank (fastest 1.0); ``None`` before the first measurement.
        self.in_force: list[float] | None = None
        self._recent: dict[int, deque[float]] = {}
        #: Changes of the speeds in force so far (events).
        self.changes = 0

    def observe(self, probes: Mapping[int, float]) -> bool:
        """Fold one profiled step's kernel times (``{pipeline rank: seconds}``); whether the speeds in force changed."""
        if not probes or any(t <= 0 for t in probes.values()):
            return False
        fastest = min(probes.values())
        for rank, seconds in probes.items():
            self._recent.setdefault(rank, deque(maxlen=self.window)).append(fastest / seconds)
        n_ranks = max(probes) + 1
        estimate = [self._median(r) for r in range(n_ranks)]
        top = max(estimate)
        estimate = [v / top for v in estimate]
        if self.in_force is not None and len(self.in_force) == n_ranks and not self._left_band(estimate):
            return False
        # A new pipeline size (a repack or grow, adopted at different moments by different processes) is an event only
        # when a process is slow: every process must decide alike whether a check is due.
        changed = any(v < 1.0 - self.tolerance for v in estimate) or (
            self.in_force is not None and len(self.in_force) == n_ranks
        )
        self.in_force = estimate
        self.changes += int(changed)
        return changed

    def _median(self, rank: int) -> float:
        """The median of ``rank``'s recent ratios; of two middle values, the one nearer the speed in force.

        So that a window not yet full (or an even one) needs a majority of new measurements to move the estimate:
        half of them would otherwise stop halfway (0.75 from 1 and 0.5), and layers would move twice for one change.
        """
        values = sorted(self._recent.get(rank, ()))
        if not values:
            return 1.0
        half = len(values) // 2
        if len(values) % 2:
            return values[half]
        now = self.in_force[rank] if self.in_force is not None and rank < len(self.in_force) else 1.0
        return min(values[half - 1], values[half], key=lambda v: abs(v - now))

    def _left_band(self, estimate: Sequence[float]) -> bool:
        assert self.in_force is not None
        return any(abs(e - f) > self.tolerance * f for e, f in zip(estimate, self.in_force, strict=True))

    def planning(self, n_ranks: int) -> list[float] | None:
        """The speeds to plan a pipeline of ``n_ranks`` with (``None``: all alike, or nothing measured for them)."""
        if self.in_force is None or len(self.in_force) != n_ranks or min(self.in_force) >= 1.0 - self.tolerance:
            return None
        return list(self.in_force)

    def keep(self, keep_ranks: Sequence[int]) -> None:
        """The pipeline now runs on ``keep_ranks`` of the current ranks (a consolidation): their speeds go along."""
        if self.in_force is not None:
            self.in_force = [self.in_force[r] for r in keep_ranks if r < len(self.in_force)]
        self._recent = {new: self._recent[old] for new, old in enumerate(keep_ranks) if old in self._recent}

    def grow(self, n_ranks: int) -> None:
        """The pipeline now has ``n_ranks`` ranks (re-admitted ones are unmeasured: the reference until measured)."""
        if self.in_force is not None:
            self.in_force = (self.in_force + [1.0] * n_ranks)[:n_ranks]

    @staticmethod
    def normalise(measured: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, float]]:
        """``measured`` with every layer's times as at the reference speed: times the kernel ratio of its process.

        Layers measured without a kernel time (a trace, an older checkpoint's profile) are returned as they are.
        """
        probes = [v["probe_s"] for v in measured.values() if v.get("probe_s", 0) > 0]
        if not probes:
            return {i: dict(v) for i, v in measured.items()}
        fastest = min(probes)
        out = {}
        for i, v in measured.items():
            ratio = fastest / v["probe_s"] if v.get("probe_s", 0) > 0 else 1.0
            out[i] = {k: (x * ratio if k in TIME_FIELDS else x) for k, x in v.items()}
        return out

    @staticmethod
    def probes(measured: Mapping[int, Mapping[str, float]]) -> dict[int, float]:
        """``{pipeline rank: kernel seconds}`` of a profiled step's measurements (empty when they carry none)."""
        return {int(v["pp_rank"]): float(v["probe_s"]) for v in measured.values()
                if v.get("probe_s", 0) > 0 and "pp_rank" in v}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        recent = {str(r): list(d) for r, d in self._recent.items()}
        return {"in_force": self.in_force, "recent": recent, "changes": self.changes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.in_force = None if state.get("in_force") is None else [float(v) for v in state["in_force"]]
        self._recent = {int(r): deque((float(x) for x in d), maxlen=self.window)
                        for r, d in state.get("recent", {}).items()}  # fmt: skip
        self.changes = int(state.get("changes", 0))
