"""The balance policy's settings, once: one name, one default, one check per setting.

:class:`BalanceSettings` is what :class:`~dynmo_lightning.balance.BalancePolicy` decides by. The runtime balancer
(:class:`~dynmo_lightning.callbacks.DynMoBalancer`, whose own settings extend these) takes the same names as keyword
arguments, and the Hydra group ``balancer`` (``conf/balancer/optimal.yaml``) spells the same keys with the same
defaults; ``tests/test_settings.py`` holds the YAML and the dataclass equal.
"""

from __future__ import annotations

import dataclasses

from dynmo_lightning.balance.diffusion.driver import EXACT, MODES

#: Planning methods: ``"optimal"`` and ``"diffusion"`` re-plan at every check; ``"static_time"`` and ``"params"``
#: plan once (torchgpipe's balance_by_time, DeepSpeed's parameter balance); ``"random"`` moves to a random split at
#: every check (a chaos test of layer migration, never a performance policy).
METHODS = ("optimal", "diffusion", "static_time", "params", "random")

#: Bytes per second a migration is assumed to move until one has been measured.
DEFAULT_BANDWIDTH = 1e9


@dataclasses.dataclass(kw_only=True)
class BalanceSettings:
    """What DynMo's balance policy decides by (Hydra: the keys of the ``balancer`` group).

    Raises:
        ValueError: a setting is out of range (the message names it as ``balancer.<name>``).
    """

    method: str = "optimal"
    """``"optimal"`` (the makespan-optimal split of the measured costs at every check), ``"diffusion"`` (the
    neighbour protocol, each stage knowing its own layers' costs only), ``"static_time"`` (plan once from the first
    profile), ``"params"`` (balance parameter counts once) or ``"random"`` (a random split at every check: a test
    that migration never changes the math)."""
    every_n_steps: int = 50
    """Optimizer steps between balance checks."""
    warmup_steps: int = 5
    """Steps before profiling starts (the first steps include one-off set-up work)."""
    profile_every_n_steps: int | None = None
    """Profile one step in this many; ``None``: every ``every_n_steps // 5`` steps (at least every step), and
    always the step before a check."""
    min_gain: float = 0.05
    """Smallest predicted relative step-time gain worth a migration."""
    smoothing: float = 0.5
    """Weight of a new measurement in the moving average of layer costs, in (0, 1]."""
    window: int = 5
    """Measurements per layer whose median the moving average folds in (an outlier step does not move it)."""
    memory_capacity: float | list[float] | str | None = None
    """Bytes a process may hold (one number, or one per stage; a process holding several stages gets the smallest
    of theirs); ``"auto"``: what each process can hold on its GPU when training starts, less a margin
    (``memory_margin``): the device's free memory plus what the process holds there already (its own tensors
    count in the predicted peak; what other processes and the CUDA context hold does not count as free), no limit
    on CPU; ``None`` ignores memory. Plans, migrations, repacks and grows are checked against every rank's
    predicted peak under the schedule (``balance/steptime/memory_model.py``)."""
    memory_margin: float = 0.1
    """The part of the memory ``memory_capacity="auto"`` finds that it leaves free (fragmentation, what the model
    does not account for)."""
    balance_memory: bool = False
    """Also even out the ranks' predicted peak memory: among splits within ``balance_memory_cost`` of the fastest,
    the one whose largest over smallest peak is the smallest found (needs ``memory_capacity``)."""
    balance_memory_cost: float = 0.03
    """The step time ``balance_memory`` may give up, relative (0.03: 3 %)."""
    p2p_seconds: float = 0.0
    """Time of one activation transfer between neighbouring stages, for the step-time model."""
    bandwidth: float = DEFAULT_BANDWIDTH
    """Bytes per second a layer migration is predicted to move until one has been measured."""
    migration_overhead: float = 0.0
    """Seconds added to every predicted migration (rebuilding the stages and the schedule)."""
    repack: bool = False
    """After each check, consolidate onto the fewest processes within ``repack_tolerance`` of the best step time,
    and release the others."""
    repack_tolerance: float = 0.05
    """Accepted relative slow-down of a consolidation (0.05: 5 %)."""
    min_stages: int = 1
    """Never consolidate a pipeline below this many stages (processes of one replica)."""
    react_samples: int = 3
    """When a dynamic changes layers (freezes, prunes), profile the next this-many steps and check at once
    (0: wait for the regular check)."""
    seed: int = 0
    """Seed of ``method="random"``."""
    process_speeds: bool = True
    """Measure every process's relative speed (a calibration kernel timed when a step is profiled), plan each stage's
    time as its costs over its process's speed, and release the slowest processes first when repacking
    (``balance/decision/speeds.py``); ``False``: every process is assumed alike (a slow process then makes its own
    layers look expensive)."""
    speed_tolerance: float = 0.1
    """Relative change of a process's measured speed that changes the speeds planned with (hysteresis: noise below
    it moves no layer)."""
    diffusion_mode: str = EXACT
    """How ``method="diffusion"`` plans: ``"exact"`` (the optimal split, about a dozen probes of ~3P rounds) or
    ``"sweep"`` (equal-share cuts in about 2P rounds, within one layer's cost of the optimum)."""

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.method in METHODS, "method", f"is not one of {list(METHODS)}"),
            (
                isinstance(self.every_n_steps, int) and self.every_n_steps >= 1,
                "every_n_steps",
                "must be an integer >= 1",
            ),
            (self.warmup_steps >= 0, "warmup_steps", "must be >= 0"),
            (
                self.profile_every_n_steps is None or self.profile_every_n_steps >= 1,
                "profile_every_n_steps",
                "must be >= 1",
            ),
            (0.0 < self.smoothing <= 1.0, "smoothing", "must be in (0, 1]"),
            (self.window >= 1, "window", "must be >= 1"),
            (self.p2p_seconds >= 0, "p2p_seconds", "must be >= 0 seconds"),
            (
                not isinstance(self.memory_capacity, str) or self.memory_capacity == "auto",
                "memory_capacity",
                "must be bytes (a number or one per stage), 'auto' or null",
            ),
            (0.0 <= self.memory_margin < 1.0, "memory_margin", "must be in [0, 1)"),
            (self.balance_memory_cost >= 0, "balance_memory_cost", "must be >= 0"),
            (self.bandwidth > 0, "bandwidth", "must be > 0 bytes per second"),
            (self.migration_overhead >= 0, "migration_overhead", "must be >= 0 seconds"),
            (self.repack_tolerance >= 0, "repack_tolerance", "must be >= 0"),
            (self.min_stages >= 1, "min_stages", "must be >= 1"),
            (self.react_samples >= 0, "react_samples", "must be >= 0"),
            (0.0 <= self.speed_tolerance < 1.0, "speed_tolerance", "must be in [0, 1)"),
            (self.diffusion_mode in MODES, "diffusion_mode", f"is not one of {list(MODES)}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"balancer.{name}={getattr(self, name)!r} {rule}")
