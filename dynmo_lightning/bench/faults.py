"""A fault for benchmarks and tests: one process runs ``factor`` times slower, as on a slow device.

It emulates a straggler - a throttled CPU, a noisy neighbour - on which every kernel of one process takes ``factor``
times as long: forward, backward, the optimizer and any calibration kernel the process times itself.

How: :class:`Slowdown` is a ``TorchDispatchMode`` that times (``time.perf_counter``) every ``aten`` op its thread
dispatches; each op leaves ``(factor - 1) * elapsed`` seconds owed, paid at once by holding the core (a busy wait:
precise at the tens of microseconds a small op takes, where ``time.sleep`` overshoots; ``min_sleep`` can batch it)
and in full when the mode exits. The autograd engine runs a CPU backward on the calling thread with that
thread's dispatch modes, so the backward is slowed too. Ops outside the ``aten`` namespace (``c10d``,
``_c10d_functional``, ``_dtensor``, ``profiler``, ...) communicate or wait: they are neither timed nor slowed, since a
slow device does not slow its peers' messages. :class:`SlowProcess` is the Lightning callback that holds the mode on
one rank from a given step on, steadily or intermittently; :func:`parse_straggler` reads its command-line spec.

Why not ``time.sleep`` once per step: a fixed delay per step does not scale with the layers a process holds, so moving
layers off the slow process could not help, while on a really slow device every kernel is slower.

Limits: CPU only (on GPUs kernels run asynchronously, so timing an op on the host measures its launch). Dispatching
every op through Python adds overhead of its own to the slowed process, which a benchmark measures as part of that
process's speed. The ops a non-``aten`` op runs inside itself run below the mode, unseen: a custom op's compute is
not slowed. For benchmarks and tests only: never a production path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from typing_extensions import override


def _spin(seconds: float) -> None:
    """Hold the core for ``seconds``, as a slower kernel would (``time.sleep`` overshoots short waits by ~0.1 ms)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# Indirections the tests replace, so that no test depends on wall-clock time.
_clock = time.perf_counter
_sleep = _spin

#: The patterns of :class:`SlowProcess`.
PATTERNS = ("steady", "intermittent")

#: The command-line form that :func:`parse_straggler` reads.
STRAGGLER_FORMAT = "RANK:FACTOR[:FROM_STEP[:PATTERN[:PERIOD]]]"


class Slowdown(TorchDispatchMode):
    """While active, every ``aten`` op this thread dispatches takes ``factor`` times as long.

    Args:
        factor: how many times as long each op takes (1 leaves the speed as it is).
        min_sleep: the debt, in seconds, from which it is paid (0: after every op, so that a kernel timed under
            the mode, like the balancer's calibration kernel, is slowed within its own timing).

    Attributes:
        owed: seconds still owed (paid when it reaches ``min_sleep`` and when the mode exits).
        slept: seconds waited in total (as asked of the wait), over every time the mode was active.
    """

    def __init__(self, factor: float, min_sleep: float = 0.0) -> None:
        super().__init__()
        _check(factor=factor)
        if min_sleep < 0:
            raise ValueError(f"min_sleep={min_sleep} must be >= 0 seconds")
        self.factor = factor
        self.min_sleep = min_sleep
        self.owed = 0.0
        self.slept = 0.0

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not _slowed(func):
            return func(*args, **(kwargs or {}))
        start = _clock()
        out = func(*args, **(kwargs or {}))
        self.owed += (self.factor - 1.0) * (_clock() - start)
        if self.owed >= self.min_sleep:
            self._pay()
        return out

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        # The rest of the debt belongs to the ops already run: pay it before the caller goes on (and times itself).
        self._pay()

    def _pay(self) -> None:
        if self.owed > 0:
            _sleep(self.owed)
            self.slept += self.owed
            self.owed = 0.0


class SlowProcess(Callback):
    """Slow the process of one global rank by ``factor`` from optimizer step ``from_step`` on.

    At each ``on_train_batch_start`` it decides (:func:`slow_at`) whether the coming step is slow, entering its
    :class:`Slowdown` when the process becomes slow and exiting it when it stops being slow. Between those the mode
    stays active, hooks included, so a calibration kernel timed in ``on_train_batch_end`` is slowed as well.

    Args:
        rank: the global rank to slow.
        factor: how many times as long each op takes there.
        from_step: the first optimizer step (``trainer.global_step``) that is slow.
        pattern: ``"steady"`` slows every step from ``from_step`` on; ``"intermittent"`` slows ``period`` steps,
            then runs ``period`` steps at full speed, and so on.
        period: the length, in steps, of each slow and each fast window of ``"intermittent"``.
    """

    def __init__(self, rank: int, factor: float, from_step: int = 0, pattern: str = "steady", period: int = 10) -> None:
        _check(rank=rank, factor=factor, from_step=from_step, pattern=pattern, period=period)
        self.rank = rank
        self.from_step = from_step
        self.pattern = pattern
        self.period = period
        self.slowdown = Slowdown(factor)
        self.active = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if trainer.global_rank == self.rank and device.type != "cpu":
            raise ValueError(
                f"SlowProcess emulates a slow CPU process; on GPUs ({device}) kernels run asynchronously, so timing "
                "an op on the host measures its launch, not its run: use the straggler setting with "
                "accelerator='cpu', or leave it out on GPUs"
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != self.rank:
            return
        slow = slow_at(trainer.global_step, self.from_step, self.pattern, self.period)
        if slow and not self.active:
            # Entered and exited by hand rather than with ``with``: the slow window spans many hooks.
            self.slowdown.__enter__()
            self.active = True
        elif not slow:
            self._stop()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if not self.active:
            return
        # Modes form a stack and exiting pops the top: popping another one would leave ours active.
        if _get_current_dispatch_mode() is not self.slowdown:
            raise RuntimeError(
                "SlowProcess cannot exit its Slowdown: another dispatch mode entered after it is still active; "
                "exit that mode first (dispatch modes are a stack)"
            )
        self.slowdown.__exit__(None, None, None)
        self.active = False


def slow_at(step: int, from_step: int, pattern: str, period: int) -> bool:
    """Whether optimizer step ``step`` is slow (see :class:`SlowProcess` for the arguments)."""
    if step < from_step:
        return False
    return pattern == "steady" or ((step - from_step) // period) % 2 == 0


def parse_straggler(text: str) -> dict[str, Any]:
    """The keyword arguments of :class:`SlowProcess` from a spec ``RANK:FACTOR[:FROM_STEP[:PATTERN[:PERIOD]]]``.

    Args:
        text: e.g. ``"1:1.5"``, ``"1:1.5:20"`` or ``"1:1.5:20:intermittent:10"``.

    Raises:
        ValueError: a spec of another form, a field that is not a number, or a value :class:`SlowProcess` refuses.
    """
    fields = text.strip().split(":")
    if not 2 <= len(fields) <= 5:
        raise ValueError(f"straggler spec {text!r} must read {STRAGGLER_FORMAT}, e.g. '1:1.5:20'")
    names = ("rank", "factor", "from_step", "pattern", "period")
    kinds = (int, float, int, str, int)
    kwargs: dict[str, Any] = {}
    for name, kind, field in zip(names, kinds, fields, strict=False):
        try:
            kwargs[name] = kind(field)
        except ValueError:
            raise ValueError(
                f"straggler spec {text!r}: {name} {field!r} must be {kind.__name__} ({STRAGGLER_FORMAT})"
            ) from None
    _check(**kwargs)
    return kwargs


def _slowed(func: Any) -> bool:
    """Whether :class:`Slowdown` times and slows ``func``: ``aten`` ops compute, other namespaces talk or wait."""
    return getattr(func, "namespace", None) == "aten"


def _check(rank: int = 0, factor: float = 1.0, from_step: int = 0, pattern: str = "steady", period: int = 1) -> None:
    """Raise unless :class:`SlowProcess` accepts these arguments (the defaults pass)."""
    if rank < 0:
        raise ValueError(f"rank={rank} must be a global rank, >= 0")
    if factor < 1:
        raise ValueError(f"factor={factor} must be >= 1 (1 runs at full speed; 2 takes twice as long)")
    if from_step < 0:
        raise ValueError(f"from_step={from_step} must be >= 0 (0 slows from the first step)")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} must be one of {PATTERNS}")
    if period < 1:
        raise ValueError(f"period={period} must be >= 1 step")
