"""Smoothed per-layer costs: what the balancer (and the simulator's replay of it) plans from."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any

from dynmo_lightning.balance.steptime.memory_model import LayerBytes


class CostTracker:
    """Robust moving averages of every layer's measured costs (the same on every process).

    Each update folds, per layer and field, the median of the last ``window`` measurements into an exponential moving
    average. The median is there because timings are heavy-tailed: one step where the OS preempted a process makes
    one layer look many times its cost, and an optimal partition planned on that one sample isolates the layer and
    packs the others more densely — slower on every following step (replaying CPU traces at 64 stages, a plan from
    raw single samples ran 0.64x of the uniform split of equal layers; with the median of 5, 1.0x). A real, lasting
    change of cost passes the median after ``window // 2 + 1`` measurements.

    Args:
        n_layers: number of pipeline layers.
        smoothing: weight of a new (median) measurement in the moving average (1.0 keeps only the latest).
        window: measurements per layer the median is taken over (1: no median).
    """

    #: ``bwd_weight``: the weight part of ``bwd`` (zero-bubble ``W`` tasks; 0 where the schedule runs it whole); the
    #: bytes are what :class:`~dynmo_lightning.balance.steptime.memory_model.LayerBytes` describes
    #: (:meth:`layer_memory`).
    FIELDS = (
        "fwd", "bwd", "bwd_weight", "activation_bytes", "param_bytes", "grad_bytes", "optim_bytes",
        "recompute_bytes", "input_bytes", "weight_copies_bytes", "gathered_bytes",
        # FSDP2 units that can run either way (``fsdp_memory``): their gradients and gathered weights each way
        "fast_grad_bytes", "fast_copies_bytes", "lean_grad_bytes", "lean_gathered_bytes",
    )  # fmt: skip

    def __init__(self, n_layers: int, smoothing: float = 0.5, window: int = 5) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing} must be in (0, 1]")
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.n_layers = n_layers
        self.smoothing = smoothing
        self.window = window
        self.values: dict[str, list[float]] = {f: [0.0] * n_layers for f in self.FIELDS}
        self._recent: dict[str, list[deque[float]]] = self._empty_recent()
        self.samples = 0
        #: Layers whose history restarts with their next measurement (see :meth:`restart`).
        self._restarted: set[int] = set()

    def _empty_recent(self) -> dict[str, list[deque[float]]]:
        return {f: [deque(maxlen=self.window) for _ in range(self.n_layers)] for f in self.FIELDS}

    def update(self, measured: dict[int, dict[str, float]]) -> None:
        """Fold one profiled step's measurements (``{layer: {field: value}}`` for all layers) into the averages.

        Fields a measurement lacks count as 0 (e.g. memory in a trace that has times only).
        """
        missing = set(range(self.n_layers)) - set(measured)
        if missing:
            raise ValueError(f"profile is missing layers {sorted(missing)[:5]}")
        a = 1.0 if self.samples == 0 else self.smoothing
        for field, values in self.values.items():
            recent = self._recent[field]
            for i in range(self.n_layers):
                recent[i].append(float(measured[i].get(field, 0.0)))
                weight = 1.0 if i in self._restarted else a
                values[i] = weight * statistics.median(recent[i]) + (1 - weight) * values[i]
        self._restarted.clear()
        self.samples += 1

    def restart(self, layers: Iterable[int]) -> None:
        """Forget the history of ``layers``: they changed (frozen, pruned), so what was measured before is stale.

        Their next measurement replaces their averages outright, and their median window starts again from it.
        """
        for i in layers:
            for recent in self._recent.values():
                recent[i].clear()
            self._restarted.add(i)

    @property
    def compute(self) -> list[float]:
        """Forward plus backward time per layer and micro-batch."""
        return [f + b for f, b in zip(self.values["fwd"], self.values["bwd"], strict=True)]

    def memory(self, inflight_microbatches: int) -> list[float]:
        """Bytes a layer needs on its stage with ``inflight_microbatches`` micro-batches' activations alive.

        The per-layer sum of the diffusion protocol, where every stage knows only its own layers; the central
        planner prices whole stages under the schedule (:meth:`layer_memory`).
        """
        v = self.values
        return [
            v["param_bytes"][i]
            + v["grad_bytes"][i]
            + v["optim_bytes"][i]
            + inflight_microbatches * v["activation_bytes"][i]
            for i in range(self.n_layers)
        ]

    def layer_memory(self, fsdp_memory: str | None = None) -> list[LayerBytes]:
        """Every layer's smoothed bytes as the memory model takes them.

        Args:
            fsdp_memory: price FSDP2 units that can run either way as ``"fast"`` or ``"lean"`` would hold them
                (``None``: as they ran when measured).
        """
        v = self.values
        out = []
        for i in range(self.n_layers):
            grads, copies, gathered = v["grad_bytes"][i], v["weight_copies_bytes"][i], v["gathered_bytes"][i]
            if fsdp_memory is not None and v["fast_copies_bytes"][i] > 0:
                fast = fsdp_memory == "fast"
                grads = v["fast_grad_bytes" if fast else "lean_grad_bytes"][i]
                copies = v["fast_copies_bytes"][i] if fast else 0.0
                gathered = 0.0 if fast else v["lean_gathered_bytes"][i]
            out.append(LayerBytes(v["param_bytes"][i], grads, v["optim_bytes"][i], v["activation_bytes"][i],
                                  v["recompute_bytes"][i], v["input_bytes"][i], copies=copies,
                                  gathered=gathered))  # fmt: skip
        return out

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        recent = {f: [list(d) for d in ds] for f, ds in self._recent.items()}
        state = {"values": self.values, "samples": self.samples, "smoothing": self.smoothing, "recent": recent}
        return {**state, "restarted": sorted(self._restarted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the layer count must match; older states without ``recent`` load too)."""
        if len(state["values"]["fwd"]) != self.n_layers:
            raise ValueError(
                f"saved costs describe {len(state['values']['fwd'])} layers, the model has {self.n_layers}"
            )
        # a field an older checkpoint lacks starts at 0, as before its first measurement
        self.values = {f: list(state["values"].get(f, [0.0] * self.n_layers)) for f in self.FIELDS}
        self.samples = int(state["samples"])
        self._restarted = {int(i) for i in state.get("restarted", [])}
        self._recent = self._empty_recent()
        for field, per_layer in state.get("recent", {}).items():
            if field in self._recent:
                for d, saved in zip(self._recent[field], per_layer, strict=True):
                    d.extend(float(x) for x in saved)
