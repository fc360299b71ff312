"""The profiler measures every layer inside the real step and never changes the math."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.balance import CostTracker
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT

pytestmark = pytest.mark.timeout(300)


class Profile(L.Callback):
    """Profiles the steps in `steps` and keeps what the profiler measured."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.measured, self.losses = steps, {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps:
            trainer.strategy.pipeline_control.request_profile()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step - 1 in self.steps:
            self.measured[trainer.global_step - 1] = trainer.strategy.pipeline_control.profile_results()


def _fit(steps: set[int]) -> tuple[Profile, GPT]:
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32, mlp_ratio=[8, 1, 1])
    cb = Profile(steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DynMoStrategy(n_microbatches=4),
        max_steps=4,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=16, max_bytes=100_000))
    return cb, model


def test_profiles_every_layer_and_leaves_the_math_alone():
    profiled, _ = _fit({1, 2, 3})
    plain, _ = _fit(set())
    assert profiled.losses == plain.losses  # hooks observe only: bit-identical training
    assert sorted(profiled.measured) == [1, 2, 3]
    for costs in profiled.measured.values():
        assert sorted(costs) == list(range(5))  # embedding, 3 blocks, head
        for i, c in costs.items():
            assert c["fwd"] > 0 and c["bwd"] > 0, (i, c)  # embedding backward is timed by its parameters' grads
            assert c["activation_bytes"] > 0 and c["param_bytes"] > 0 and c["grad_bytes"] == c["param_bytes"]
            # Adam: two moments per parameter plus a 4-byte step counter per tensor
            assert 2 * c["param_bytes"] <= c["optim_bytes"] <= 2 * c["param_bytes"] + 4 * 16
    # the 8x MLP block saves more activations than a 1x block
    last = profiled.measured[3]
    assert last[1]["activation_bytes"] > 2 * last[2]["activation_bytes"]


def test_cost_tracker_moving_average_and_state():
    tracker = CostTracker(2, smoothing=0.5, window=1)
    row = {"fwd": 1.0, "bwd": 2.0, "activation_bytes": 10, "param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8}
    tracker.update({0: row, 1: {**row, "fwd": 3.0}})
    tracker.update({0: {**row, "fwd": 3.0}, 1: row})
    assert tracker.values["fwd"] == [2.0, 2.0]
    assert tracker.compute == [4.0, 4.0]
    assert tracker.memory(inflight_microbatches=2) == [36.0, 36.0]
    clone = CostTracker(2)
    clone.load_state_dict(tracker.state_dict())
    assert clone.values == tracker.values and clone.samples == 2
    with pytest.raises(ValueError, match="missing layers"):
        tracker.update({0: row})
    with pytest.raises(ValueError, match="describe 2 layers, the model has 3"):
        CostTracker(3).load_state_dict(tracker.state_dict())
    assert torch.tensor(tracker.compute).sum() == 8.0


def test_cost_tracker_ignores_a_one_step_spike_but_follows_a_lasting_change():
    tracker = CostTracker(1, smoothing=1.0, window=5)
    row = {"fwd": 1.0, "bwd": 2.0}
    for fwd in (1.0, 1.0, 1.0, 9.0):  # one preempted step
        tracker.update({0: {**row, "fwd": fwd}})
    assert tracker.values["fwd"] == [1.0] and tracker.values["param_bytes"] == [0.0]
    for _ in range(3):  # the layer really got slower (e.g. a dynamic technique changed it)
        tracker.update({0: {**row, "fwd": 4.0}})
    assert tracker.values["fwd"] == [4.0]
    clone = CostTracker(1, smoothing=1.0, window=5)
    clone.load_state_dict(tracker.state_dict())
    clone.update({0: {**row, "fwd": 1.0}})
    tracker.update({0: {**row, "fwd": 1.0}})
    assert clone.values == tracker.values  # the window survives a checkpoint
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        CostTracker(1, window=0)


class _Ticks:
    """A clock that advances one tick per reading (deterministic durations, no wall clock)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 1.0
        return self.t

    def elapsed(self, start: float, end: float) -> float:
        return end - start


def test_split_backward_is_timed_in_its_input_and_weight_parts():
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from dynmo_lightning.profiling import LayerProfiler

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    profiler = LayerProfiler(torch.device("cpu"), clock=_Ticks())
    profiler.start()
    x = torch.randn(3, 4, requires_grad=True)  # a later stage's input: it carries a gradient
    out = profiler.run(layers, 1, x)
    params = [p for layer in layers for p in layer.parameters()]
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
    assert all(p.grad is None for p in params)  # the input pass computed no weight gradient
    with profiler.weight_pass():
        stage_backward_weight(iter(params), groups)
    assert all(p.grad is not None for p in params)
    costs = profiler.stop()
    assert sorted(costs) == [1, 2]
    for cost in costs.values():
        assert cost.bwd_input > 0 and cost.bwd_weight > 0  # both parts seen, for each layer
        assert cost.bwd == cost.bwd_input + cost.bwd_weight


def test_full_backward_is_all_input_part():
    from dynmo_lightning.profiling import LayerProfiler

    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    profiler = LayerProfiler(torch.device("cpu"), clock=_Ticks())
    profiler.start()
    x = torch.randn(3, 4, requires_grad=True)
    profiler.run(layers, 0, x).sum().backward()
    for cost in profiler.stop().values():
        assert cost.bwd_weight == 0.0 and cost.bwd == cost.bwd_input > 0
