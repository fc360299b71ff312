"""Host reads of tensor values (GPU stream stalls) per training step, for each dynamic: the documented counts.

Counted on CPU with patched ``Tensor.item/tolist/__bool__/__int__/__float__`` (:class:`HostSyncCounter`), through
``DynMoStrategy`` with one stage, for 2 and 4 blocks and 2 and 4 micro-batches. Each dynamic's count is what it adds to
a run without dynamics (Lightning itself reads the progress-bar loss once per step) outside the optimizer step (Adam's
step counts are CPU tensors unless ``capturable``/``fused``: no device sync). The first two steps (stage building,
shape probes) are left out. The counts are README's table "Host syncs per step"; each case also checks that the
dynamic really acted, so a count of zero cannot come from a dynamic that did nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as L
import pytest

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import (
    DynamicSparseAttention,
    GradualPruning,
    HostSyncCounter,
    LayerFreezing,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.models.routing import DepthRouter, ExitGate
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention

STEPS = 8
SHAPES = [(2, 2), (4, 2), (4, 4)]  # (blocks, micro-batches)
#: Rebuilding the stages after layers changed reads once (torch.distributed.pipelining's warm-up vote).
REBUILD = 1


def _count(make: Callable[[], L.Callback] | None, n_blocks: int, microbatches: int) -> tuple[list[int], GPT]:
    """Reads per step (steps 2..), the optimizer step's own left out; and the trained model."""
    L.seed_everything(0)
    model = GPT(n_layer=n_blocks, n_embd=32, n_head=2, block_size=32, warmup_steps=0, tie_embeddings=False)
    counter = HostSyncCounter()
    callbacks = [counter] if make is None else [make(), counter]
    strategy = DynMoStrategy(n_microbatches=microbatches)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, strategy=strategy, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with counter.patched():
        trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000, seed=0))
    assert len(counter.counts) == STEPS
    return [c - o for c, o in zip(counter.counts, counter.optimizer_counts, strict=True)][2:], model


@pytest.fixture(scope="module")
def baseline() -> dict[tuple[int, int], list[int]]:
    return {shape: _count(None, *shape)[0] for shape in SHAPES}


def _extra(make: Callable[[], L.Callback], shape: tuple[int, int], baseline: dict) -> tuple[list[int], GPT]:
    counts, model = _count(make, *shape)
    return [c - b for c, b in zip(counts, baseline[shape], strict=True)], model


def test_without_dynamics_only_lightnings_own_read(baseline):
    # Lightning turns the logged loss into a number for the progress bar each step; nothing of ours reads.
    assert all(counts == [1] * (STEPS - 2) for counts in baseline.values()), baseline


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_freezing_reads_once_per_step(shape, baseline):
    make = lambda: LayerFreezing(mode="auto", check_every_n_steps=2, start_step=0, percentile=90.0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    # All layers' gradient norms in one read each step; a check (after steps 1, 3, 5, 7) gathers the window's norms
    # from every stage, a collective whose sizes are read too; the step after a freeze rebuilds the stages (REBUILD).
    checks = [step % 2 for step in range(2, STEPS)]
    assert all(1 + c <= n <= 1 + c + REBUILD for n, c in zip(extra, checks, strict=True)), extra
    assert any(not p.requires_grad for p in model.parameters()), "AutoFreeze froze nothing"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_pruning_reads_only_on_pruning_steps(shape, baseline):
    make = lambda: GradualPruning(final_sparsity=0.5, start_step=2, end_step=6, every_n_steps=2)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    # Steps 1, 3, 5 prune (global steps 2, 4, 6 at their end): one gather of every stage's scores (its sizes) and
    # one read of the local scores; the next step rebuilds the stages.
    bound = {1: 2, 3: 2, 5: 2, 2: REBUILD, 4: REBUILD, 6: REBUILD}
    assert all(n <= bound.get(step, 0) for step, n in enumerate(extra, start=2)), extra
    assert model.blocks[0].mlp.fc.out_features < 4 * 32, "nothing was pruned"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_early_exit_reads_once_per_stage_and_microbatch(shape, baseline):
    _, microbatches = shape
    make = lambda: TokenEarlyExit(threshold=0.5, warmup_steps=0, ramp_steps=0, sync="stage")  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    assert extra == [microbatches] * len(extra)  # one stage: one read per micro-batch, whatever the depth
    assert sum(int(m.exited) for m in model.modules() if isinstance(m, ExitGate)) > 0, "no token exited"


@pytest.mark.timeout(300)
def test_early_exit_per_layer_reads_are_bounded(baseline):
    n_blocks, microbatches = shape = (4, 2)
    make = lambda: TokenEarlyExit(threshold=0.5, warmup_steps=0, ramp_steps=0, sync="layer")  # noqa: E731
    extra, _ = _extra(make, shape, baseline)
    assert all(n <= n_blocks * microbatches for n in extra), extra  # the exact count of each block (CPU default)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_mixture_of_depths_reads_nothing(shape, baseline):
    make = lambda: MixtureOfDepths(capacity=0.25, every=2, start_step=0, anneal_steps=0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    assert extra == [0] * len(extra)  # k is fixed by the capacity, kept on the host
    routers = [m for m in model.modules() if isinstance(m, DepthRouter)]
    assert routers and all(0 < r.routed < r.seen for r in routers), "no block routed a share of its tokens"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_mixture_of_experts_reads_once_per_moe_layer_and_microbatch(shape, baseline):
    _, microbatches = shape
    make = lambda: MixtureOfExperts(n_experts=4, every=2, top_k=1, capacity_factor=1.0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    moe_layers = sum(isinstance(m, MoEMLP) for m in model.modules())
    # The experts' loads size their matmuls: the one unavoidable read of a load-proportional MoE layer.
    assert extra == [moe_layers * microbatches] * len(extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_attention_reads_at_most_once_per_step(shape, baseline):
    make = lambda: DynamicSparseAttention(attn_block=8, density=0.5, target_coverage=0.9)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    assert all(n <= 1 for n in extra), extra  # all layers' coverage in one read after the step
    densities = [float(m.density) for m in model.modules() if isinstance(m, SparseCausalSelfAttention)]
    assert densities and any(d != 0.5 for d in densities), "no density adapted"
