"""Layer costs injected into the balancer's measurements, so that tests about its decisions never depend on timing.

The real profiler still runs (the collectives and the cadence are the real ones); only the measured times are
replaced by a cost proportional to what the layer computes: forward ``param_bytes`` and backward twice its
``grad_bytes`` (zero for a frozen layer, smaller for a pruned one), at one microsecond per byte - large enough that
any migration pays for itself, so a decision depends on the planned gain alone.
"""

from __future__ import annotations

from typing import Any

from dynmo_lightning.strategy.control import PipelineHandle

SECONDS_PER_BYTE = 1e-6


def structural(measured: dict[int, dict[str, float]], *, tail_scale: float = 1.0) -> dict[int, dict[str, float]]:
    """The measurements with times replaced by the structural cost of each layer (every process at one speed).

    ``tail_scale``: layers after the first two cost this share (as if most tokens left the model after its first
    block, as under early exit).
    """
    return {
        i: {
            **m,
            "fwd": (1.0 if i < 2 else tail_scale) * SECONDS_PER_BYTE * m["param_bytes"],
            "bwd": (1.0 if i < 2 else tail_scale) * 2 * SECONDS_PER_BYTE * m["grad_bytes"],
            # every process alike unless a test makes one slow: the measured kernel times are timings too
            "probe_s": 1.0,
        }
        for i, m in measured.items()
    }


def slowed(measured: dict[int, dict[str, float]], rank: int, factor: float, on: bool) -> dict[int, dict[str, float]]:
    """The measurements as if pipeline rank ``rank`` ran ``factor`` times slower (when ``on``): its layers' times and
    its calibration kernel's time (``probe_s``) times ``factor``; every other process's kernel takes 1 s."""
    out = {}
    for i, m in measured.items():
        slow = on and int(m["pp_rank"]) == rank
        scale = factor if slow else 1.0
        out[i] = {**m, "fwd": m["fwd"] * scale, "bwd": m["bwd"] * scale, "probe_s": scale}
    return out


def inject(load_rises_at: int | None = None, slow_process: tuple[int, float, int] | None = None) -> None:
    """Make every ``DynMoStrategy`` of this process report structural costs (a test's worker calls this first).

    The costs are what its pipeline handle (``strategy.pipeline_control``, the balancer's ``Rebalancing`` role)
    reports.

    With ``load_rises_at``, the layers after the first two cost 1 % until that step and fully from then on: the load
    of a pipeline that fits on few ranks rises again (the layers' math is unchanged). With ``slow_process = (pipeline
    rank, factor, from step)``, that process is a straggler from that step on (:func:`slowed`): speeds are injected
    too, never timed.
    """
    measure = PipelineHandle.profile_results

    def profile_results(self: PipelineHandle) -> Any:
        measured = measure(self)
        step = self._step()
        tail = 0.01 if load_rises_at is not None and step < load_rises_at else 1.0
        if measured is None:
            return None
        costs = structural(measured, tail_scale=tail)
        if slow_process is not None:
            rank, factor, start = slow_process
            costs = slowed(costs, rank, factor, step >= start)
        return costs

    PipelineHandle.profile_results = profile_results  # type: ignore[method-assign]


# `PYTHONPATH=tests python tests/support/injected_costs.py OVERRIDES...`: dynmo-train with injected costs.
if __name__ == "__main__":
    from dynmo_lightning.cli import train

    inject()
    train()
