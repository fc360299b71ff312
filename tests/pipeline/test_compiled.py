"""``strategy.compile``: every layer compiled in place trains as eager (P = 2, layers moving every 5 steps), also
under the dynamics and ZBV, compiles at most a graph per distinct layer kind (identical blocks share one) and does
not recompile step after step.

Compiling is slow on this CPU (seconds per graph), so the blocks are tiny and all cases run in one launch. Each
case starts from a fresh dynamo and fails at dynamo's recompile limit (``support.strict_compile``): its graphs are
its own, as in a run of its own process, so they can be counted; and past the limit dynamo would run the layers
eagerly, silently, so that "compiled" equalled eager trivially (sharing one process's dynamo, the cases before
early exit gave ``Block.forward`` 8 graphs, and early exit, MoE and ZBV then ran their blocks eagerly).

What used to reach the limit or fail, each also checked in one process in seconds (dynamo without inductor): early
exit recompiled at every change of its threshold (dynamo guarded the threshold buffer's version counter inside
``host_value``; host state now runs eagerly between graphs, the gate's computation compiled); Mixture of Depths at
every call (its token counts, ints on the router; not in the launch above); MoE's grouped GEMM did not trace in fp32
(torch's fake ``grouped_mm`` wants bf16); and every prune gave every block a graph of its widths (parameter shapes
were static). A layer dynamo gives up on is named in a warning.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from functools import partial

import lightning.pytorch as L
import pytest
import torch
from support.helpers import FREEZE, TINY, CliRun, assert_close_losses, launch
from torch import nn
from torch._dynamo.utils import counters

from dynmo_lightning.callbacks import GradualPruning
from dynmo_lightning.core.context import stage_forward
from dynmo_lightning.core.host_values import set_host_value
from dynmo_lightning.models.blocks import Block
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.pipeline.parallel.compiled import check_options, compile_layer

STEPS = ["trainer.max_steps=20", "trainer.val_check_interval=null", "trainer.limit_val_batches=0"]
#: A first compile takes minutes on a loaded CPU while the next rank waits in its first receive: a longer timeout.
BASE = [
    *(o for o in TINY if not o.startswith("strategy.timeout=")),
    "strategy.timeout=900",
    # every case compiles from a fresh dynamo, and dynamo's recompile limit fails the run instead of running eager
    "model._target_=support.strict_compile.StrictCompileGPT",
]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=5", "balancer.warmup_steps=0"]
DYNAMICS = {
    "none": [],
    "freezing": FREEZE,
    # seven prunes: with static parameter shapes, past the recompile limit
    "pruning": ["dynamics=pruning", "dynamics.start_step=2", "dynamics.end_step=14", "dynamics.every_n_steps=2"],
    "early_exit": ["dynamics=early_exit", "dynamics.warmup_steps=2", "dynamics.ramp_steps=4"],
    "moe": ["dynamics=moe", "dynamics.n_experts=4", "dynamics.every=2"],
}
ZBV = ["strategy.schedule=zbv", "strategy.stages_per_rank=2"]
#: Graphs a compiled case may compile in a step after the first, at most (a dynamic's shapes change by design:
#: dynamo makes the changing sizes dynamic after it met two of them).
RECOMPILE_BOUND = {"none": 0, "freezing": 0, "pruning": 0, "early_exit": 4, "moe": 4}
#: The reference GPT's kinds of layers: the embedding, the block (its copies share one graph) and the head.
KINDS = 3
#: Graphs a compiled case may compile on global rank 0 in all: one per kind of layer it held, where a dynamic makes
#: more kinds: a frozen layer is another (dynamo guards ``requires_grad``); a pruned block a few (parameter shapes
#: turn dynamic when a prune first changes them: its neurons', its heads' if later, a size of 1 specialised); MoE's
#: changing sizes once (dense and MoE blocks); and early exit's blocks compile in pieces between their host reads (the
#: active-token count, the boolean gather of exactly the active tokens, the gate's threshold) whose gathered sizes are
#: specialised at 0 and 1 before they turn dynamic.
GRAPHS_AT_MOST = {
    "none": KINDS,
    "zbv": KINDS,
    "freezing": 2 * KINDS,
    "pruning": KINDS + 3,
    "early_exit": 4 * KINDS,
    "moe": 2 * (KINDS + 1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("compiled")
    variants = {**{name: [*RANDOM, *dyn] for name, dyn in DYNAMICS.items()}, "zbv": [*RANDOM, *ZBV]}
    cases = {}
    for name in variants:
        cases[d / f"eager-{name}"] = [*STEPS, *variants[name]]
        cases[d / f"compiled-{name}"] = [*STEPS, *variants[name], "strategy.compile=true"]
    try:
        launch(2, cases, timeout=1700, base=BASE)
        failed = ""
    except AssertionError as e:  # the cases that finished are still compared; the others fail with this log
        failed = str(e)
    return {path.name: (CliRun(path), failed) for path in cases}


def _summary(runs, case: str) -> dict:
    run, failed = runs[case]
    assert (run.run_dir / "summary.json").exists(), f"{case} did not finish:\n{failed}"
    return run.summary


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [*DYNAMICS, "zbv"])
def test_compiled_layers_train_as_eager_while_they_move(runs, name):
    eager, compiled = _summary(runs, f"eager-{name}"), _summary(runs, f"compiled-{name}")
    assert len(compiled["partitions"]) >= 3  # moved (and compiled again on arrival)
    assert_close_losses(compiled["losses"], eager["losses"], rtol=1e-4)
    assert sum(eager["compiled_graphs_per_step"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [*DYNAMICS, "zbv"])
def test_compiled_graphs_are_bounded_by_the_kinds_of_layers(runs, name):
    per_step = _summary(runs, f"compiled-{name}")["compiled_graphs_per_step"]
    # more than none: this case compiled (from a fresh dynamo) and did not run eagerly
    assert 0 < sum(per_step) <= GRAPHS_AT_MOST[name], per_step


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(DYNAMICS))
def test_compiled_layers_do_not_recompile_every_step(runs, name):
    summary = _summary(runs, f"compiled-{name}")
    per_step = summary["compiled_graphs_per_step"]
    # a move or a dynamic that changed layers (frozen, pruned: other shapes) may compile the step after it
    events = {p["step"] for p in summary["partitions"]} | set(summary["layers_changed"])
    later = [n for step, n in enumerate(per_step) if step >= 3 and step not in events]
    assert max(later, default=0) <= RECOMPILE_BOUND[name], per_step


def test_compile_options_are_checked():
    assert check_options(False) is None and check_options(True) == {}
    assert check_options({"mode": "max-autotune-no-cudagraphs"}) == {"mode": "max-autotune-no-cudagraphs"}
    with pytest.raises(ValueError, match=r"strategy.compile has unknown torch.compile options \['modes'\]"):
        check_options({"modes": "x"})
    with pytest.raises(ValueError, match=r"strategy.compile='yes' must be false, true or a dict"):
        check_options("yes")


# ---------------------------------------------------------------------------------------------------------------------
# In one process, dynamo without inductor (seconds): the causes of the failures above, each on its own.


@pytest.fixture
def strict_dynamo():
    """A fresh dynamo whose recompile limit is an error (as ``support.strict_compile``), fresh again afterwards."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _blocks(n: int, graphs: list[str] | None = None, **kwargs) -> tuple[list[Block], list[Block]]:
    """``n`` tiny blocks, compiled by dynamo alone (no inductor: the guards are dynamo's), and eager copies.

    The code of every graph compiled goes to ``graphs``.
    """

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):
        if graphs is not None:
            graphs.append(gm.code)
        return gm.forward

    torch.manual_seed(0)
    eager = [Block(32, 4, 64, 0.0, True, **kwargs) for _ in range(n)]
    compiled = copy.deepcopy(eager)
    for block in compiled:
        compile_layer(block, {"backend": backend})
    return compiled, eager


def _as_eager(compiled: list[Block], eager: list[Block], state: tuple, setup: Callable[[Block], None]) -> tuple:
    """``state`` through the compiled blocks and through the eager ones (``setup`` each first), checked equal."""
    outputs = []
    for blocks in (compiled, eager):
        out = state
        with stage_forward():
            for block in blocks:
                setup(block)
                out = block(*out)
        outputs.append(out)
    for c, e in zip(*outputs, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    return outputs[0]


def _gate(block: Block, threshold: float, sync: str = "auto") -> None:
    block.exit_gate.may_exit, block.exit_gate.sync = True, sync
    set_host_value(block.exit_gate, "threshold", threshold)


def _capacity(block: Block, capacity: float) -> None:
    set_host_value(block.depth_router, "capacity", capacity)


def test_a_threshold_schedule_compiles_nothing_once_exits_are_on(strict_dynamo):
    codes: list[str] = []
    compiled, eager = _blocks(2, codes, early_exit=True)
    # off (above 1), then a new threshold every step: all below every token's similarity (a hidden state ten times
    # the blocks' contribution), so the tokens that exit, and the shapes, stay the same
    thresholds = [2.0, 2.0, *(0.5 + 0.04 * step for step in range(10))]
    h = 10 * torch.randn(2, 16, 32)
    graphs = []
    for threshold in thresholds:
        _, active, _ = _as_eager(
            compiled, eager, (h, torch.ones(2, 16), torch.zeros(2)), partial(_gate, threshold=threshold)
        )
        graphs.append(_graphs())
    assert active.sum() < active.numel()  # tokens exited
    counts = [[(int(b.exit_gate.exited), int(b.exit_gate.processed)) for b in blocks] for blocks in (compiled, eager)]
    assert counts[0] == counts[1], counts
    # the gate compiles at the first step with exits, then nothing
    assert graphs[2] > graphs[1] and graphs[3:] == [graphs[2]] * (len(thresholds) - 3), graphs
    assert any("cosine_similarity" in code for code in codes)  # the gate runs compiled, not eagerly after the read


@pytest.mark.parametrize("sync", ["layer", "stage"])
def test_active_token_bounds_compile_no_graph_per_value(strict_dynamo, sync):
    # a micro-batch of another number of active tokens each time: bounds read per layer, or once per stage and kept
    # in the stage's memo; dynamo makes the sizes dynamic, and compiles nothing per value
    compiled, eager = _blocks(3, early_exit=True)
    h = torch.randn(2, 16, 32)
    graphs = []
    for step, n in enumerate([16, 0, 1, *range(15, 1, -1)]):  # none active, one (sizes dynamo specialises), more
        active = torch.ones(2, 16)
        active[:, n:] = 0
        _as_eager(compiled, eager, (h, active, torch.zeros(2)), partial(_gate, threshold=0.9 - 0.01 * step, sync=sync))
        graphs.append(_graphs())
    assert graphs[-10:] == [graphs[-10]] * 10, graphs
    # the bound is read eagerly: its few operations are no graph of their own (traced: one more, and its variants)
    assert graphs[-1] <= 10, graphs


def test_a_capacity_schedule_compiles_nothing_once_its_sizes_are_dynamic(strict_dynamo):
    # Mixture of Depths: the capacity falls every step, so each block routes another number of tokens
    compiled, eager = _blocks(2, mod_capacity=1.0)
    h = torch.randn(2, 16, 32)
    graphs = []
    for capacity in [1.0, 1.0, *(0.9 - 0.06 * step for step in range(10))]:
        _as_eager(compiled, eager, (h, torch.ones(2, 16), torch.zeros(2)), partial(_capacity, capacity=capacity))
        graphs.append(_graphs())
    assert [b.depth_router.seen for b in compiled] == [b.depth_router.seen for b in eager]
    assert [b.depth_router.routed for b in compiled] == [b.depth_router.routed for b in eager]
    # the routed sizes turn dynamic after two of them (three capacities)
    assert graphs[4:] == [graphs[4]] * (len(graphs) - 4), graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_moe_layer_runs_its_grouped_gemm_in_fp32_and_bf16(strict_dynamo, dtype):
    torch.manual_seed(0)
    eager = MoEMLP(16, 32, 4).to(dtype)
    compiled = copy.deepcopy(eager)
    # AOTAutograd traces the backward too (the grouped GEMM's gradients), without inductor's minutes on this CPU
    compile_layer(compiled, {"backend": "aot_eager"})
    x, valid = torch.randn(2, 8, 16, dtype=dtype), torch.rand(2, 8) > 0.25
    assert compiled.masks_on_device(x)  # the grouped path (a mask of real rows: early exit's padding)
    for _ in range(2):
        outputs = []
        for moe in (compiled, eager):
            y, aux = moe(x, valid)
            (y.float().square().sum() + aux).backward()
            outputs.append((y, aux, *(p.grad for p in moe.parameters())))
        for c, e in zip(*outputs, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert _graphs() == 1


def test_pruned_compiled_blocks_share_a_graph_of_dynamic_widths(strict_dynamo):
    compiled, eager = _blocks(2)
    pruning = GradualPruning()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    static = torch._dynamo.config.force_parameter_static_shapes
    pruning.setup(trainer, L.LightningModule(), "fit")
    try:
        x = torch.randn(2, 16, 32, requires_grad=True)  # as the second block's input: one graph for both
        graphs = []
        # unpruned, then nine prunes: with static parameter shapes, more graphs than dynamo's recompile limit
        widths = [(4, 64), (4, 60), (3, 52), (3, 50), (3, 41), (2, 33), (2, 30), (2, 20), (2, 16), (2, 12)]
        for heads, neurons in widths:
            for blocks in (compiled, eager):
                for i, block in enumerate(blocks):
                    block.attn.keep_units(torch.arange(heads))
                    block.mlp.keep_units(torch.arange(neurons - i * (neurons < 64)))  # blocks of different widths
            torch.testing.assert_close(compiled[1](compiled[0](x)), eager[1](eager[0](x)), rtol=1e-5, atol=1e-6)
            graphs.append(_graphs())
    finally:
        pruning.teardown(trainer, L.LightningModule(), "fit")
    # static widths; the neurons' dynamic at the first prune; the heads' at theirs (every block shares them)
    assert graphs == [1, 2, *[3] * 8], graphs
    assert torch._dynamo.config.force_parameter_static_shapes == static  # as before the fit


def test_a_layer_dynamo_gives_up_on_is_named_in_a_warning(strict_dynamo):
    layer = nn.Linear(4, 4)
    compile_layer(layer, {"backend": "eager", "dynamic": False}, name="3")  # a graph per batch size
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none before the limit
            layer(torch.randn(1, 4)), layer(torch.randn(2, 4))
        with pytest.warns(RuntimeWarning) as caught:
            y = layer(x := torch.randn(3, 4))
    message = str(caught[0].message)
    assert message.startswith("torch.compile gave up on layer 3, which runs eagerly from now on"), message
    assert "hit config.recompile_limit (2)" in message and "last reason: " in message and "size mismatch" in message
    torch.testing.assert_close(y, nn.functional.linear(x, layer.weight, layer.bias))  # eager, and right
