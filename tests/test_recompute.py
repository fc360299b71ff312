"""Activation checkpointing in one process: exact, recomputes only where it should, repeats the forward's host-side
decisions without counting statistics twice, and the profiler sees the recomputation in backward time and memory."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError

from dynmo_lightning import DynMoStrategy, recompute
from dynmo_lightning.models import GPT
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime, StagePlan
from dynmo_lightning.pipeline.stage.slots import LayerSlots, StageModule
from dynmo_lightning.profiling import LayerProfiler
from dynmo_lightning.protocol import set_host_value
from dynmo_lightning.recompute import checkpoint_policy, checkpointed_call

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(n_layer=3, n_embd=32, n_head=4, block_size=32, tie_embeddings=False, **kw)
    model.configure_model()
    return model


def _step(model: GPT, recompute_layers, batch, profiler: LayerProfiler | None = None):
    """Forward and backward of one batch through all layers as one stage; the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    x, y = batch
    torch.manual_seed(1)  # the same dropout draws in both runs
    stage = StageModule(model.pipeline_layers(), 0, profiler, recompute_layers)
    loss = model.pipeline_loss(stage(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(seed: int = 2, b: int = 4, t: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def _count_calls(layers) -> list[int]:
    counts = [0] * len(layers)
    for i, layer in enumerate(layers):
        # a pre-hook: a recomputation stops (early) once it has rebuilt what backward needs, before the forward ends
        layer.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


# --- the setting ---------------------------------------------------------------------------------------------------
def test_settings_choose_layers_by_global_index_or_predicate():
    layers = [nn.Linear(2, 2), Block(8, 2, 16, 0.0, True), nn.Linear(2, 2), Block(8, 2, 16, 0.0, True)]
    chosen = lambda setting: [i for i, layer in enumerate(layers) if checkpoint_policy(setting)(i, layer)]  # noqa: E731
    assert checkpoint_policy(None) is None
    assert chosen("all") == chosen(1) == [0, 1, 2, 3]
    assert chosen(2) == [1, 3] and chosen(3) == [2]
    assert chosen(lambda index, layer: isinstance(layer, Block)) == [1, 3]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (-1, r"strategy.activation_checkpointing=-1 must be a positive integer k"),
        (0, r"strategy.activation_checkpointing=0 must be a positive integer k"),
        (True, r"strategy.activation_checkpointing=True must be a positive integer k"),
        ("every", r"strategy.activation_checkpointing='every' is not a known setting: use None \(off\), 'all'"),
        (2.5, r"strategy.activation_checkpointing=2.5 has an unusable type"),
        (lambda layer: True, r"strategy.activation_checkpointing=.*\(layer\) cannot be called as \(index, layer\)"),
        (lambda a, b, c: True, r"cannot be called as \(index, layer\).*e\.g\. `lambda index, layer:"),
    ],
)
def test_bad_settings_are_refused_at_construction(setting, message):
    with pytest.raises(ValueError, match=message):
        DynMoStrategy(activation_checkpointing=setting)


def test_good_settings_are_accepted_at_construction():
    # getattr: a builtin whose signature Python cannot tell; it is trusted (and would fail when the stages are built)
    for setting in (None, "all", 3, lambda index, layer: index > 0, getattr):
        assert DynMoStrategy(activation_checkpointing=setting).activation_checkpointing is setting


@pytest.mark.parametrize(("override", "setting"), [("null", None), ("all", "all"), ("2", 2)])
def test_the_hydra_key(override, setting):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from dynmo_lightning.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"strategy.activation_checkpointing={override}", "run_dir=/tmp/x"])
    assert instantiate(cfg.strategy).activation_checkpointing == setting


# --- exactness and where recomputation happens --------------------------------------------------------------------
def test_recomputed_training_is_bit_identical_with_dropout():
    model = _gpt(dropout=0.2)
    batch = _batch()
    loss, grads = _step(model, (), batch)
    loss_ckpt, grads_ckpt = _step(model, range(5), batch)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() and all(torch.equal(grads[k], grads_ckpt[k]) for k in grads)


def test_checkpointed_layers_run_twice_in_training_once_without_autograd_or_frozen():
    model = _gpt()
    layers = model.pipeline_layers()
    counts = _count_calls(layers)
    _step(model, [1, 3], _batch())
    assert counts == [1, 2, 1, 2, 1]  # forward of every layer, recomputation of the chosen ones in backward
    counts[:] = [0] * 5
    with torch.no_grad():
        StageModule(layers, 0, None, range(5))(_batch()[0])
    assert counts == [1] * 5  # evaluation: nothing to recompute
    for layer in layers[:2]:  # a frozen prefix runs without autograd: no checkpoint, nothing kept
        layer.requires_grad_(False)
        layer.pipeline_frozen = True
    counts[:] = [0] * 5
    profiler = LayerProfiler(CPU)
    profiler.start()
    _step(model, range(5), _batch(), profiler)
    assert counts == [1, 1, 2, 2, 2]
    costs = profiler.stop()
    assert costs[0].activation_bytes == costs[1].activation_bytes == 0
    assert costs[0].recompute_bytes == costs[1].recompute_bytes == 0
    assert costs[2].recompute_bytes > 0


def test_the_runtime_chooses_by_global_index_wherever_a_layer_runs():
    model = _gpt()
    layers = model.pipeline_layers()
    asked = []

    def odd_blocks(index: int, layer: nn.Module) -> bool:
        asked.append(index)
        return isinstance(layer, Block) and index % 2 == 1

    runtime = PipelineRuntime(
        LayerSlots(model, layers),
        StagePlan((2, 3), 1),  # two stages on one rank: stage_modules builds both
        pipe=SimpleNamespace(rank=0),
        device=CPU,
        schedule="gpipe",
        n_microbatches=1,
        loss_fn=model.pipeline_loss,
        recompute=odd_blocks,
    )
    assert [sorted(m.recompute) for m in runtime.stage_modules()] == [[1], [3]]
    runtime.set_plan(StagePlan((4, 1), 1))  # layers moved: layer 3 now runs on the first stage, still recomputed
    assert [sorted(m.recompute) for m in runtime.stage_modules()] == [[1, 3], []]
    assert asked == [0, 1, 2, 3, 4] * 2  # asked again whenever the stages are built


# --- host-side decisions and statistics ---------------------------------------------------------------------------
def _exiting_gpt() -> GPT:
    """Blocks read their active-token bound once per stage, and about half the tokens exit after the first block."""
    model = _gpt(early_exit=True)
    x = _batch()[0]
    embed, first = model.pipeline_layers()[:2]
    with torch.no_grad():
        h = embed(x)[0]
        similarity = F.cosine_similarity(h, first(h), dim=-1)
    for block in model.blocks:
        block.exit_gate.sync, block.exit_gate.may_exit = "stage", True
        set_host_value(block.exit_gate, "threshold", statistics.median(similarity.flatten().tolist()))
    return model


def test_a_recomputed_block_replays_the_stage_memo_of_its_forward():
    model = _exiting_gpt()
    batch = _batch()
    loss, grads = _step(model, (), batch)
    exited = [int(b.exit_gate.exited) for b in model.blocks]
    assert 0 < exited[0] < batch[0].numel()  # tokens left after the first block: the later bound is a stale one
    for b in model.blocks:
        b.exit_gate.exited = b.exit_gate.processed = 0
    loss_ckpt, grads_ckpt = _step(model, [2, 3], batch)
    assert torch.equal(loss, loss_ckpt) and all(torch.equal(grads[k], grads_ckpt[k]) for k in grads)
    assert [int(b.exit_gate.exited) for b in model.blocks] == exited  # counted once


def test_without_the_replayed_memo_the_recomputation_would_be_refused(monkeypatch):
    # The negative control of the test above: a recomputation that reads its own bound gets other shapes.
    monkeypatch.setattr(recompute, "_replay", lambda memo: recompute.probing())
    model = _exiting_gpt()
    with pytest.raises(CheckpointError):
        _step(model, [2, 3], _batch())


def _statistics(model: GPT) -> list:
    out = []
    for block in model.blocks:
        router, attn, mlp = block.depth_router, block.attn, block.mlp
        out += [getattr(router, "routed", None), getattr(router, "seen", None), attn._coverage_n]
        out += [float(attn._coverage_sum), float(attn.density), getattr(mlp, "tokens_per_expert", None)]
    return out


def _dynamic_gpt() -> GPT:
    """Mixture of Depths, adaptive sparse attention and Mixture of Experts: statistics that a recount would change."""
    return _gpt(mod_every=2, mod_capacity=0.5, n_experts=2, attention="sparse", attn_block=8, attn_target_coverage=0.9)


@pytest.mark.parametrize("replay", [True, False])
def test_statistics_are_counted_once(monkeypatch, replay):
    if not replay:  # the negative control: a recomputation that counts
        monkeypatch.setattr(recompute, "probing", lambda: torch.enable_grad())
    batch = _batch()
    plain, ckpt = _dynamic_gpt(), _dynamic_gpt()
    for model, layers in ((plain, ()), (ckpt, range(5))):
        for attn in (b.attn for b in model.blocks):
            set_host_value(attn, "density", 0.5)
        _step(model, layers, batch)
        model.on_train_batch_end(None, None, 0)  # adapts the densities from the step's coverage
    assert plain.blocks[1].depth_router.routed > 0 and plain.blocks[0].attn._coverage_n == 0  # measured, adapted
    assert (_statistics(ckpt) == _statistics(plain)) is replay


# --- what the profiler measures -----------------------------------------------------------------------------------
class TickClock:
    """A clock that layers advance themselves: forward costs 10 ticks, backward 1 (no wall clock)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def elapsed(self, start: float, end: float) -> float:
        return end - start


class _Tick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: TickClock) -> torch.Tensor:
        ctx.clock = clock
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.t += 1
        return grad, None


class Costly(nn.Module):
    def __init__(self, clock: TickClock) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((64,), 0.5))
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.t += 10
        return _Tick.apply(torch.tanh(x * self.w), self.clock)


@pytest.mark.parametrize("recomputed", [(), (1,), (0, 1, 2)])
def test_profiled_backward_time_includes_the_recomputation(recomputed):
    clock = TickClock()
    layers = [Costly(clock) for _ in range(3)]
    profiler = LayerProfiler(CPU, clock=clock)
    profiler.start()
    stage = StageModule(layers, 0, profiler, recomputed)
    for _ in range(2):  # two micro-batches: per micro-batch averages
        stage(torch.randn(4, 64, requires_grad=True)).sum().backward()
    costs = profiler.stop()
    assert {i: c.fwd for i, c in costs.items()} == {0: 10, 1: 10, 2: 10}
    assert {i: c.bwd for i, c in costs.items()} == {i: 11 if i in recomputed else 1 for i in range(3)}


def test_profiled_memory_of_a_checkpointed_layer_is_its_input_and_its_recomputation_apart():
    block = _gpt().blocks[0]  # plain hidden states in: its first operation (a layer norm) keeps its input
    x = torch.randn(4, 32, 32, requires_grad=True)
    measured = {}
    for recomputed in ((), (0,)):
        profiler = LayerProfiler(CPU)
        profiler.start()
        StageModule([block], 0, profiler, recomputed)(x).sum().backward()
        measured[recomputed] = profiler.stop()[0]
    plain, ckpt = measured[()], measured[(0,)]
    assert plain.recompute_bytes == 0 and ckpt.activation_bytes == x.numel() * 4  # only its input is kept
    # what the recomputation rebuilds is what the plain layer keeps besides its input
    assert ckpt.activation_bytes + ckpt.recompute_bytes == plain.activation_bytes


def _split_backward_run(checkpointed: bool) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Three layers with dropout through torch's input and weight passes; the gradients and the recomputations."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from dynmo_lightning.recompute import recomputations, shared_recomputation

    torch.manual_seed(0)
    layers = nn.ModuleList(
        [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8)) for _ in range(3)]
    )
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    before, out = recomputations(), x
    with shared_recomputation():
        for layer in layers:
            out = checkpointed_call(layer, out) if checkpointed else layer(out)
    grads, groups = stage_backward_input([out], [torch.ones_like(out)], [x], layers.parameters())
    stage_backward_weight(layers.parameters(), groups)
    return [p.grad for p in layers.parameters()], grads[0], recomputations() - before


def test_a_split_backward_recomputes_each_layer_once_for_both_passes():
    """Zero-bubble's input pass and weight pass read one recomputation (torch's checkpoint would run one per pass)."""
    plain, plain_dx, none = _split_backward_run(checkpointed=False)
    grads, dx, recomputed = _split_backward_run(checkpointed=True)
    assert (none, recomputed) == (0, 3)
    torch.testing.assert_close(dx, plain_dx, rtol=0, atol=0)  # the same dropout masks, bit for bit
    for g, p in zip(grads, plain, strict=True):
        torch.testing.assert_close(g, p, rtol=0, atol=0)
