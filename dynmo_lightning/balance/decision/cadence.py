"""When a balancing policy measures and asks: its cost tracker, the profile and check cadence, events, its state.

:class:`PolicyCadence` is the measuring half of :class:`~dynmo_lightning.balance.decision.policy.BalancePolicy` (the
cadence is described there); the decision itself, and what it plans with, is the policy's.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from dynmo_lightning.balance.decision.policy_settings import DEFAULT_BANDWIDTH, BalanceSettings
from dynmo_lightning.balance.decision.speeds import ProcessSpeeds
from dynmo_lightning.balance.decision.tracker import CostTracker
from dynmo_lightning.settings import resolve

#: Methods that plan once and never again.
ONE_SHOT = ("static_time", "params")


class PolicyCadence:
    """Measured costs and cadence of a balancing policy: what it tracks, when it profiles, when a check is due.

    Args:
        method: one of :data:`METHODS`, or the whole
            :class:`~dynmo_lightning.balance.decision.policy_settings.BalanceSettings`.
        **settings: the other fields of :class:`~dynmo_lightning.balance.decision.policy_settings.BalanceSettings`
            (names, defaults and meaning there), over ``method``'s when that is a settings object.

    Raises:
        ValueError: a setting is out of range (the message names it).
        TypeError: an unknown setting.
    """

    def __init__(self, method: str | BalanceSettings = "optimal", **settings: Any) -> None:
        given, overrides = (
            (method, settings) if isinstance(method, BalanceSettings) else (None, {"method": method, **settings})
        )
        s = self.settings = resolve(BalanceSettings, "BalancePolicy", "balancer", given, overrides)
        self.profile_every_n_steps = s.profile_every_n_steps or max(1, s.every_n_steps // 5)
        #: Bytes per second of a migration: the setting until one is measured (:meth:`record_migration`).
        self.bandwidth = s.bandwidth
        self.tracker: CostTracker | None = None
        self.planned_once = False
        #: The most ranks the pipeline has had (with those waiting to come back): the size repack tolerances refer to.
        self.full_stages = 0
        #: Fresh measurements since the last event (``None``: no event waiting for its check).
        self.after_event: int | None = None
        #: Every pipeline rank's relative speed (``process_speeds``), from the kernel times of profiled steps.
        self.speeds = ProcessSpeeds(s.speed_tolerance)
        self._rng = random.Random(s.seed)

    # ----------------------------------------------------------------------------------------------------------------
    def start(self, n_layers: int) -> CostTracker:
        """Begin (or continue) measuring a model of ``n_layers`` layers; returns the tracker."""
        if self.tracker is None or self.tracker.n_layers != n_layers:
            self.tracker = CostTracker(n_layers, self.settings.smoothing, self.settings.window)
        return self.tracker

    @property
    def done(self) -> bool:
        """Whether the policy will never plan again (a one-shot method that has planned)."""
        return self.settings.method in ONE_SHOT and self.planned_once

    def wants_profile(self, step: int) -> bool:
        """Whether the step about to run (``step`` steps done before it) should be profiled."""
        if self.settings.method == "random" or self.done or step < self.settings.warmup_steps:
            return False
        if self.after_event is not None:
            return True
        return (step + 1) % self.profile_every_n_steps == 0 or (step + 1) % self.settings.every_n_steps == 0

    def observe(self, measured: dict[int, dict[str, float]]) -> None:
        """Fold one profiled step's costs (``{layer: {field: value}}``, every layer) into the tracker.

        With ``process_speeds``, layers that carry their process's kernel time (``probe_s``, ``pp_rank``) are first
        normalised to the reference speed, and the kernel times update the speeds; a change of the speeds in force
        is an event: the next step checks (the costs' history stays, they are speed-free).
        """
        if self.tracker is None:
            self.start(len(measured))
        assert self.tracker is not None
        if self.settings.process_speeds:
            changed = self.speeds.observe(ProcessSpeeds.probes(measured))
            measured = ProcessSpeeds.normalise(measured)
            if changed and self._reacts:
                self.after_event = max(self.after_event or 0, self.settings.react_samples)
        self.tracker.update(measured)
        if self.after_event is not None:
            self.after_event += 1

    @property
    def _reacts(self) -> bool:
        """Whether events lead to an early check (not under one-shot or random methods, or ``react_samples=0``)."""
        return self.settings.method != "random" and not self.done and bool(self.settings.react_samples)

    def layers_changed(self, layers: Iterable[int]) -> None:
        """An event: ``layers`` changed (a dynamic technique froze or pruned them); react.

        How: see :mod:`~dynmo_lightning.balance.decision.policy`'s docstring.
        """
        if self.tracker is None or not self._reacts:
            return
        self.tracker.restart(layers)
        self.after_event = 0

    def due(self, step: int) -> bool:
        """Whether a check is due now that ``step`` optimizer steps are done."""
        if step <= self.settings.warmup_steps or self.done:
            return False
        reacting = self.after_event is not None and self.after_event >= self.settings.react_samples
        if step % self.settings.every_n_steps and not reacting:
            return False
        return self.settings.method in ("random", "params") or bool(self.tracker and self.tracker.samples)

    def record_migration(self, moved: float, seconds: float) -> None:
        """Fold a measured migration (``moved`` bytes in ``seconds``) into the bandwidth estimate."""
        if moved and seconds > 0:
            self.bandwidth = 0.5 * self.bandwidth + 0.5 * (moved / seconds)

    # ----------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the tracked costs, the bandwidth estimate, whether it planned, the random state."""
        return {
            "tracker": self.tracker.state_dict() if self.tracker is not None else None,
            "bandwidth": self.bandwidth,
            "planned_once": self.planned_once,
            "after_event": self.after_event,
            "full_stages": self.full_stages,
            "rng": self._rng.getstate(),
            "speeds": self.speeds.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], n_layers: int | None = None) -> None:
        """Restore :meth:`state_dict` (the tracker once ``n_layers`` is known)."""
        self.bandwidth = float(state.get("bandwidth", DEFAULT_BANDWIDTH))
        self.planned_once = bool(state.get("planned_once", False))
        self.after_event = state.get("after_event")
        self.full_stages = int(state.get("full_stages", 0))
        if state.get("speeds") is not None:
            self.speeds.load_state_dict(state["speeds"])
        if state.get("rng") is not None:
            version, internal, gauss = state["rng"]  # a checkpoint turns the tuples into lists
            self._rng.setstate((version, tuple(internal), gauss))
        if n_layers is not None and state.get("tracker") is not None:
            self.start(n_layers).load_state_dict(state["tracker"])
