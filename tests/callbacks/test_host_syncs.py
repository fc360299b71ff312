"""Host reads of tensor values (GPU stream stalls) per training step, for each dynamic: the documented counts.

Counted on CPU by :class:`HostSyncCounter`: patched ``Tensor.item/tolist/__bool__/__int__/__float__`` and a
``TorchDispatchMode`` that sees data-dependent operators (``nonzero``, boolean-mask indexing, ``_local_scalar_dense``,
...) and tensors made from Python data (``lift_fresh``), each read counted once, through ``DynMoStrategy`` with one
stage, clipping by the global norm on, for 2 and 4 blocks and 2 and 4 micro-batches. ``own_counts`` leave out
Lightning's own reads (its progress-bar and logged values) and the optimizer step's (Adam's step counts are CPU
tensors unless ``capturable``/``fused``: no device sync). The first two steps (stage building, shape probes) are left
out. Early exit runs with ``sync="stage"``, what accelerators use. The counts are the table in ``docs/host_syncs.md``;
each case also checks that the dynamic really acted, so a count of zero cannot come from a dynamic that did nothing.
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
#: Rebuilding the stages after layers changed reads once (torch.distributed.pipelining's warm-up vote) and makes
#: one tensor from host data, and the clipping's index tensors of the new layout are made (two).
REBUILD = 4
#: A pickled all-gather of Python objects (``protocol.all_gather``): sizes and bytes of every part.
CHECK = 6


def _count(make: Callable[[], L.Callback] | None, n_blocks: int, microbatches: int) -> tuple[list[int], GPT]:
    """Our reads per step (steps 2..), Lightning's and the optimizer step's left out; and the trained model."""
    L.seed_everything(0)
    model = GPT(n_layer=n_blocks, n_embd=32, n_head=2, block_size=32, warmup_steps=0, tie_embeddings=False)
    counter = HostSyncCounter()
    callbacks = [counter] if make is None else [make(), counter]
    strategy = DynMoStrategy(n_microbatches=microbatches)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, strategy=strategy, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=0.5)  # fmt: skip
    with counter.patched():
        trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000, seed=0))
    assert len(counter.counts) == len(counter.own_counts) == STEPS
    return counter.own_counts[2:], model


@pytest.fixture(scope="module")
def baseline() -> dict[tuple[int, int], list[int]]:
    return {shape: _count(None, *shape)[0] for shape in SHAPES}


def _extra(make: Callable[[], L.Callback], shape: tuple[int, int], baseline: dict) -> tuple[list[int], GPT]:
    counts, model = _count(make, *shape)
    return [c - b for c, b in zip(counts, baseline[shape], strict=True)], model


def test_without_dynamics_nothing_of_ours_reads(baseline):
    # Clipping by the global norm included: its index tensors are made once per layout, before step 2.
    assert all(counts == [0] * (STEPS - 2) for counts in baseline.values()), baseline


def test_lightnings_own_reads_are_seen_and_kept_apart():
    counter = HostSyncCounter()
    L.seed_everything(0)
    model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=32, warmup_steps=0, tie_embeddings=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, strategy=DynMoStrategy(n_microbatches=2),
                        callbacks=[counter], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with counter.patched():
        trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000, seed=0))
    sites = counter.dispatch_sites[-1]
    # Lightning reads the logged loss for its progress bar; Adam its (CPU) step counts: both named, neither ours.
    assert any(k.startswith("[lightning] method Tensor.item") for k in sites), sites
    assert any(k.startswith("[optimizer] ") for k in sites), sites
    assert counter.own_counts[-1] == 0 and counter.counts[-1] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_freezing_reads_once_per_step(shape, baseline):
    make = lambda: LayerFreezing(mode="auto", check_every_n_steps=2, start_step=0, percentile=90.0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    # The layers' gradient norms add up on the device; a check (after steps 1, 3, 5, 7) reads the window's sums (one
    # read) and gathers them from every stage (a pickled all-gather: CHECK reads); the step after a freeze rebuilds
    # the stages (REBUILD). Between checks: nothing, but for that rebuild.
    checks = [step % 2 for step in range(2, STEPS)]
    assert all(n <= c * (1 + CHECK) + REBUILD for n, c in zip(extra, checks, strict=True)), extra
    assert 0 in extra, extra
    assert any(not p.requires_grad for p in model.parameters()), "AutoFreeze froze nothing"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_pruning_reads_only_on_pruning_steps(shape, baseline):
    make = lambda: GradualPruning(final_sparsity=0.5, start_step=2, end_step=6, every_n_steps=2)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    # Steps 1, 3, 5 prune (global steps 2, 4, 6 at their end): one read of the local scores, a gather of every
    # stage's scores, one index tensor of kept units per pruned module; the next step rebuilds the stages.
    modules = 2 * (n := shape[0])  # every block's MLP and attention
    bound = {s: 1 + CHECK + modules for s in (1, 3, 5)} | {s: REBUILD for s in (2, 4, 6)}
    assert all(k <= bound.get(step, 0) for step, k in enumerate(extra, start=2)), (extra, n)
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
    # Per block and micro-batch (the CPU default, where reads are free): its exact count, then a boolean gather of
    # exactly the active tokens for the MLP, forward and backward.
    assert all(n <= 3 * n_blocks * microbatches for n in extra), extra


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
def test_mixture_of_experts_reads_nothing_with_grouped_experts(shape, baseline):
    make = lambda: MixtureOfExperts(n_experts=4, every=2, top_k=1, capacity_factor=1.0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    moe = [m for m in model.modules() if isinstance(m, MoEMLP)]
    assert moe and all(m.masks_on_device(next(m.parameters())) for m in moe)
    # One grouped GEMM per expert matrix over device offsets: the loads never reach the host.
    assert extra == [0] * len(extra)
    assert all(min(m.tokens_per_expert) < max(m.tokens_per_expert) for m in moe), "routing was even"


@pytest.mark.timeout(300)
def test_mixture_of_experts_per_expert_reads_once_per_moe_layer_and_microbatch(baseline, monkeypatch):
    # Where the grouped GEMM does not run (fp32 on a GPU), each expert's load sizes its matmul: one read per call.
    monkeypatch.setattr(MoEMLP, "masks_on_device", lambda self, x: False)
    _, microbatches = shape = (4, 2)
    make = lambda: MixtureOfExperts(n_experts=4, every=2, top_k=1, capacity_factor=1.0)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    moe_layers = sum(isinstance(m, MoEMLP) for m in model.modules())
    assert extra == [moe_layers * microbatches] * len(extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_early_exit_with_moe_reads_once_per_stage_and_microbatch(shape, baseline):
    # The MoE layers of exited-token blocks get the padded rows and a mask: no boolean gather of the active tokens.
    _, microbatches = shape

    def make() -> L.Callback:
        class Both(L.Callback):
            def __init__(self) -> None:
                self.parts = [MixtureOfExperts(n_experts=4, every=2), TokenEarlyExit(threshold=0.5, warmup_steps=0,
                              ramp_steps=0, sync="stage")]  # fmt: skip

            def setup(self, trainer, pl_module, stage):
                for p in self.parts:
                    p.setup(trainer, pl_module, stage)

            def on_train_batch_start(self, trainer, pl_module, batch, idx):
                for p in self.parts:
                    getattr(p, "on_train_batch_start", lambda *a: None)(trainer, pl_module, batch, idx)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):
                for p in self.parts:
                    p.on_train_batch_end(trainer, pl_module, outputs, batch, idx)

        return Both()

    extra, model = _extra(make, shape, baseline)
    assert extra == [microbatches] * len(extra), extra
    assert sum(int(m.exited) for m in model.modules() if isinstance(m, ExitGate)) > 0, "no token exited"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_attention_reads_at_most_once_per_step(shape, baseline):
    make = lambda: DynamicSparseAttention(attn_block=8, density=0.5, target_coverage=0.9)  # noqa: E731
    extra, model = _extra(make, shape, baseline)
    assert all(n <= 1 for n in extra), extra  # all layers' coverage in one read after the step
    densities = [float(m.density) for m in model.modules() if isinstance(m, SparseCausalSelfAttention)]
    assert densities and any(d != 0.5 for d in densities), "no density adapted"
