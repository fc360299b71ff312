"""Bad input gets a clear error naming the setting and the fix, before training starts — never a hang."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.models import GPT
from dynmo_lightning.protocol import ProtocolError

pytestmark = pytest.mark.timeout(120)


def _loader(batch_size: int = 8, n: int = 32) -> DataLoader:
    x = torch.randint(0, 256, (n, 16))
    return DataLoader(TensorDataset(x, x), batch_size=batch_size, drop_last=True)


def _fit(model: L.LightningModule, strategy: DynMoStrategy, loader: DataLoader | None = None, **trainer_kw) -> None:
    kw = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kw.update(trainer_kw)
    L.Trainer(strategy=strategy, **kw).fit(model, loader or _loader())


def tiny_gpt(**kw) -> GPT:
    return GPT(n_layer=2, n_embd=16, n_head=2, block_size=16, **kw)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"8 pipeline stages, but the model has only 4 layers.*fewer devices"):
        _fit(tiny_gpt(), DynMoStrategy(schedule="interleaved_1f1b", stages_per_rank=8, n_microbatches=8))


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"batch of 6 samples does not split into strategy.n_microbatches=4"):
        _fit(tiny_gpt(), DynMoStrategy(n_microbatches=4), _loader(batch_size=6))


def test_model_without_protocol():
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 4)

    with pytest.raises(ProtocolError, match=r"no `pipeline_layers\(\)` and no `pipeline_loss\(.*\)`"):
        _fit(Plain(), DynMoStrategy())


def test_partition_must_sum_to_layer_count():
    with pytest.raises(ValueError, match=r"sums to 3 but the model has 4 layers"):
        _fit(tiny_gpt(), DynMoStrategy(partition=[3], n_microbatches=2))


def test_partition_length_must_match_devices():
    with pytest.raises(ValueError, match=r"partition=\[2, 2\] has 2 stages but the Trainer runs 1 processes"):
        _fit(tiny_gpt(), DynMoStrategy(partition=[2, 2]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_microbatches": 0}, "n_microbatches=0 must be a positive integer"),
        ({"schedule": "zigzag"}, r"schedule='zigzag' is not one of"),
        ({"partition": "random"}, r"partition='random' is not one of"),
        ({"stages_per_rank": 0}, "stages_per_rank=0 must be a positive integer"),
    ],
)
def test_bad_strategy_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynMoStrategy(**kwargs)


def test_interleaved_schedule_constraints():
    from dynmo_lightning.pipeline.runtime import check_schedule

    with pytest.raises(ValueError, match="interleaved_1f1b' needs at least 2 processes"):
        _fit(tiny_gpt(), DynMoStrategy(schedule="interleaved_1f1b", stages_per_rank=2))
    with pytest.raises(ValueError, match="stages_per_rank >= 2"):
        check_schedule("interleaved_1f1b", n_ranks=2, n_stages=2, n_microbatches=4)
    with pytest.raises(ValueError, match="must be a multiple of"):
        check_schedule("interleaved_1f1b", n_ranks=4, n_stages=8, n_microbatches=9)
    with pytest.raises(ValueError, match="1F1B needs at least one micro-batch per stage"):
        check_schedule("1f1b", n_ranks=4, n_stages=4, n_microbatches=2)


def test_zero_bubble_schedule_constraints():
    from dynmo_lightning.pipeline.runtime import check_schedule

    with pytest.raises(ValueError, match="'zbv' needs at least 2 processes"):
        _fit(tiny_gpt(), DynMoStrategy(schedule="zbv", stages_per_rank=2))
    for stages in (2, 6):  # one or three stages per rank: the V holds exactly two
        with pytest.raises(ValueError, match=r"exactly two stages on every rank .*strategy.stages_per_rank=2"):
            check_schedule("zbv", n_ranks=2, n_stages=stages, n_microbatches=4)
    with pytest.raises(ValueError, match=r"n_microbatches=3 < 4 stages: DualPipeV .*n_microbatches >= 4"):
        check_schedule("dualpipev", n_ranks=2, n_stages=4, n_microbatches=3)
    with pytest.raises(ValueError, match="'interleaved_zb' needs several stages per rank"):
        check_schedule("interleaved_zb", n_ranks=2, n_stages=2, n_microbatches=4)
    with pytest.raises(ValueError, match=r"n_microbatches=9 does not work with strategy.schedule='interleaved_zb'"):
        check_schedule("interleaved_zb", n_ranks=4, n_stages=8, n_microbatches=9)
    with pytest.raises(ValueError, match=r"stages_per_rank > 1 needs one of \['interleaved_1f1b', 'interleaved_zb'"):
        check_schedule("1f1b", n_ranks=2, n_stages=4, n_microbatches=4)
    check_schedule("zbv", n_ranks=2, n_stages=4, n_microbatches=1)  # torch's ZBV drops the missing micro-batches
    check_schedule("dualpipev", n_ranks=2, n_stages=4, n_microbatches=4)


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_split_backward_refuses_replicas_and_recomputation(schedule):
    with pytest.raises(ValueError, match=r"bypasses DDP's gradient averaging.*strategy.data_parallel_size=1"):
        DynMoStrategy(schedule=schedule, stages_per_rank=2, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"strategy.activation_checkpointing='all' is not supported with"):
        DynMoStrategy(schedule=schedule, stages_per_rank=2, activation_checkpointing="all")


def test_accumulate_grad_batches_points_to_microbatches():
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2.*n_microbatches"):
        _fit(tiny_gpt(), DynMoStrategy(n_microbatches=2), accumulate_grad_batches=2)


def test_registered_name_works():
    import dynmo_lightning  # noqa: F401

    trainer = L.Trainer(strategy="dynmo", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DynMoStrategy)
