"""The slow-process fault: ops timed and slowed by the factor, backward included; the callback's windows; the spec."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from dynmo_lightning.bench import faults
from dynmo_lightning.bench.faults import Slowdown, SlowProcess, _slowed, parse_straggler, slow_at

pytestmark = pytest.mark.timeout(60)

#: Seconds the fake clock advances per reading: a power of two, so that the sums below are exact.
TICK = 0.25


@torch.library.custom_op("dynmo_faults_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class FakeClock:
    """Each reading is ``TICK`` later than the one before: every timed op takes exactly ``TICK``."""

    def __init__(self) -> None:
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.readings * TICK


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(faults, "_clock", fake)
    return fake


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(faults, "_sleep", slept.append)
    return slept


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every op the mode looked at (timed or not)."""
    ops: list[object] = []
    monkeypatch.setattr(faults, "_slowed", lambda func: ops.append(func) or _slowed(func))
    return ops


@pytest.fixture(autouse=True)
def no_mode_left() -> Iterator[None]:
    """A mode left active would slow (or break) every test after this one: pop it, then fail."""
    yield
    mode = _get_current_dispatch_mode()
    while isinstance(mode, Slowdown):
        mode.__exit__(None, None, None)
        mode = _get_current_dispatch_mode()
    assert mode is None, "a test left a dispatch mode active"


def _trainer(rank: int, step: int = 0, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(
        global_rank=rank, global_step=step, strategy=SimpleNamespace(root_device=torch.device(device))
    )


def _forward(model: nn.Module) -> torch.Tensor:
    return nn.functional.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 3))


def _timed(ops: list[object]) -> int:
    return sum(_slowed(op) for op in ops)


def test_forward_ops_are_timed_and_owe_factor_minus_one_times_their_time(clock, sleeps, seen):
    model = nn.Linear(8, 3)
    with Slowdown(1.5) as mode:
        _forward(model)
    assert torch.ops.aten.addmm.default in seen
    # Two readings per timed op, none for anything else.
    assert clock.readings == 2 * _timed(seen) > 0
    assert mode.owed == 0.0  # paid on exit
    assert mode.slept == sum(sleeps) == pytest.approx(0.5 * TICK * _timed(seen))


def test_backward_ops_are_seen_by_the_mode_and_slowed(clock, sleeps, seen):
    # The forward runs outside the mode: whatever the mode sees below, the autograd engine ran under it.
    model = nn.Linear(8, 3)
    loss = _forward(model)
    with Slowdown(3.0) as mode:
        loss.backward()
    # The weight's gradient is a matrix product of the backward.
    assert torch.ops.aten.mm.default in seen
    assert model.weight.grad is not None
    assert clock.readings == 2 * _timed(seen) > 0
    assert mode.slept + mode.owed == pytest.approx(2.0 * TICK * _timed(seen))


def test_debt_below_min_sleep_waits_and_is_paid_in_full_on_exit(clock, sleeps, seen):
    mode = Slowdown(2.0, min_sleep=1e9)
    with mode:
        _forward(nn.Linear(8, 3))
        assert sleeps == []
        assert mode.owed == pytest.approx(TICK * _timed(seen))
    assert sleeps == [pytest.approx(TICK * _timed(seen))]
    assert mode.owed == 0.0


def test_factor_one_sleeps_nothing(clock, sleeps):
    with Slowdown(1.0) as mode:
        _forward(nn.Linear(8, 3)).backward()
    assert clock.readings > 0
    assert sleeps == [] and mode.slept == 0.0 and mode.owed == 0.0


def test_only_aten_ops_are_slowed(clock, sleeps):
    assert _slowed(torch.ops.aten.mm.default)
    assert not _slowed(torch.ops.dynmo_faults_test.double.default)
    x = torch.ones(2)
    with Slowdown(2.0):
        out = torch.ops.dynmo_faults_test.double(x)
    # The custom op is neither timed nor slowed; the ops inside it run below the mode, unseen.
    assert clock.readings == 0 and sleeps == []
    assert torch.equal(out, torch.full((2,), 2.0))


def test_real_clock_matmuls_owe_time(sleeps):
    a = torch.randn(64, 64)
    with Slowdown(3.0) as mode:
        for _ in range(50):
            a = torch.tanh(a @ a)
    assert mode.slept + mode.owed > 0
    assert sum(sleeps) == pytest.approx(mode.slept)


def test_slow_at_steady_and_intermittent():
    assert [slow_at(s, 3, "steady", 2) for s in range(7)] == [False] * 3 + [True] * 4
    intermittent = [slow_at(s, 2, "intermittent", 3) for s in range(12)]
    # Slow 2-4, fast 5-7, slow 8-10, fast 11.
    assert intermittent == [False, False, True, True, True, False, False, False, True, True, True, False]
    assert [slow_at(s, 0, "intermittent", 1) for s in range(4)] == [True, False, True, False]


def test_slow_process_enters_on_its_rank_and_step_and_leaves_when_the_window_ends(clock, sleeps):
    callback = SlowProcess(rank=1, factor=2.0, from_step=2, pattern="intermittent", period=2)
    callback.setup(_trainer(1), None, "fit")
    active = []
    for step in range(9):
        callback.on_train_batch_start(_trainer(1, step), None, None, step)
        active.append(_get_current_dispatch_mode() is callback.slowdown)
        assert callback.active == active[-1]
    assert active == [False, False, True, True, False, False, True, True, False]
    callback.on_train_batch_start(_trainer(1, 10), None, None, 10)
    # Between steps the mode stays on: a kernel timed in a hook (the balancer's calibration) is slowed too.
    torch.ones(2) + 1
    assert callback.slowdown.slept > 0
    callback.on_train_end(_trainer(1, 10), None)
    assert _get_current_dispatch_mode() is None and not callback.active
    callback.teardown(_trainer(1, 10), None, "fit")  # a second exit does nothing
    assert _get_current_dispatch_mode() is None


def test_slow_process_never_slows_another_rank(clock, sleeps):
    callback = SlowProcess(rank=1, factor=2.0)
    for step in range(4):
        callback.on_train_batch_start(_trainer(0, step), None, None, step)
        assert _get_current_dispatch_mode() is None and not callback.active


@pytest.mark.parametrize("end", ["teardown", "on_exception"])
def test_slow_process_leaves_on_teardown_and_exceptions(clock, sleeps, end):
    callback = SlowProcess(rank=0, factor=2.0)
    callback.on_train_batch_start(_trainer(0), None, None, 0)
    assert _get_current_dispatch_mode() is callback.slowdown
    if end == "teardown":
        callback.teardown(_trainer(0), None, "fit")
    else:
        callback.on_exception(_trainer(0), None, RuntimeError("boom"))
    assert _get_current_dispatch_mode() is None and not callback.active


def test_slow_process_refuses_to_pop_a_mode_entered_after_its_own(clock, sleeps):
    callback = SlowProcess(rank=0, factor=2.0)
    callback.on_train_batch_start(_trainer(0), None, None, 0)
    with TorchDispatchMode(), pytest.raises(RuntimeError, match="another dispatch mode"):
        callback.on_train_end(_trainer(0), None)
    assert callback.active
    callback.on_train_end(_trainer(0), None)
    assert _get_current_dispatch_mode() is None


def test_slow_process_refuses_gpus_on_its_rank_only():
    with pytest.raises(ValueError, match="slow CPU process; on GPUs"):
        SlowProcess(rank=1, factor=2.0).setup(_trainer(1, device="cuda"), None, "fit")
    SlowProcess(rank=1, factor=2.0).setup(_trainer(0, device="cuda"), None, "fit")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": -1}, "rank=-1 must be"),
        ({"factor": 0.5}, "factor=0.5 must be >= 1"),
        ({"from_step": -2}, "from_step=-2 must be >= 0"),
        ({"pattern": "bursty"}, "pattern='bursty' must be one of"),
        ({"period": 0}, "period=0 must be >= 1"),
    ],
)
def test_slow_process_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        SlowProcess(**{"rank": 0, "factor": 2.0, **kwargs})


def test_slowdown_argument_errors():
    with pytest.raises(ValueError, match=re.escape("factor=0.9 must be >= 1")):
        Slowdown(0.9)
    with pytest.raises(ValueError, match="min_sleep=-1 must be >= 0"):
        Slowdown(2.0, min_sleep=-1)


def test_parse_straggler():
    assert parse_straggler("1:1.5") == {"rank": 1, "factor": 1.5}
    assert parse_straggler("1:1.5:20") == {"rank": 1, "factor": 1.5, "from_step": 20}
    spec = parse_straggler(" 2:3:20:intermittent:10 ")
    assert spec == {"rank": 2, "factor": 3.0, "from_step": 20, "pattern": "intermittent", "period": 10}
    callback = SlowProcess(**spec)
    assert (callback.rank, callback.slowdown.factor, callback.period) == (2, 3.0, 10)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1", "must read RANK:FACTOR"),
        ("1:2:3:steady:4:5", "must read RANK:FACTOR"),
        ("a:1.5", "rank 'a' must be int"),
        ("1:fast", "factor 'fast' must be float"),
        ("1:1.5:2.5", "from_step '2.5' must be int"),
        ("1:1.5:0:steady:x", "period 'x' must be int"),
        ("1:0.5", "factor=0.5 must be >= 1"),
        ("1:1.5:0:bursty", "pattern='bursty' must be one of"),
    ],
)
def test_parse_straggler_errors(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_straggler(text)
