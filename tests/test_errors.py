"""Bad input gets a clear error naming the setting and the fix, before training starts or when detected; never a hang.

docs/errors.md has the whole table; the rows not tested here are tested next to their feature (tests/callbacks/,
tests/models/, ...).
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from support.helpers import V_ON_GLOO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dynmo_lightning import DynMoBalancer, DynMoStrategy, PipelineModule
from dynmo_lightning.callbacks import CostTrace, MixtureOfExperts
from dynmo_lightning.cli import CONF_DIR
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.stage.ties import TieError
from dynmo_lightning.protocol import ProtocolError

pytestmark = pytest.mark.timeout(120)


def _loader(batch_size: int = 8, n: int = 32) -> DataLoader:
    x = torch.randint(0, 256, (n, 16))
    return DataLoader(TensorDataset(x, x), batch_size=batch_size, drop_last=True)


def _fit(
    model: L.LightningModule,
    strategy: DynMoStrategy | None = None,
    loader: DataLoader | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: str | None = None,
    **trainer_kw,
) -> L.Trainer:
    """Two steps without validation on ``loader`` (the standard-library corpus, sequences of 32, by default)."""
    kw = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    kw.update(trainer_kw)
    trainer = L.Trainer(strategy=strategy or DynMoStrategy(n_microbatches=2), callbacks=list(callbacks), **kw)
    if loader is None:
        corpus = StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000)
        trainer.fit(model, datamodule=corpus, ckpt_path=ckpt_path)
    else:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def tiny_gpt(**kw) -> GPT:
    return GPT(n_layer=2, n_embd=16, n_head=2, block_size=16, **kw)


def _gpt(**kw) -> GPT:
    return GPT(n_layer=2, n_embd=32, n_head=4, block_size=32, **kw)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"8 pipeline stages, but the model has only 4 layers.*fewer devices"):
        _fit(tiny_gpt(), DynMoStrategy(schedule="interleaved_1f1b", stages_per_rank=8, n_microbatches=8), _loader())


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"batch of 6 samples does not split into strategy.n_microbatches=4"):
        _fit(tiny_gpt(), DynMoStrategy(n_microbatches=4), _loader(batch_size=6))


def test_model_without_protocol():
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 4)

    with pytest.raises(ProtocolError, match=r"no `pipeline_layers\(\)` and no `pipeline_loss\(.*\)`"):
        _fit(Plain(), DynMoStrategy(), _loader())


def test_partition_must_sum_to_layer_count():
    with pytest.raises(ValueError, match=r"sums to 3 but the model has 4 layers"):
        _fit(tiny_gpt(), DynMoStrategy(partition=[3], n_microbatches=2), _loader())


def test_partition_length_must_match_devices():
    with pytest.raises(ValueError, match=r"partition=\[2, 2\] has 2 stages but the Trainer runs 1 processes"):
        _fit(tiny_gpt(), DynMoStrategy(partition=[2, 2]), _loader())


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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fsdp_memory": "tiny"}, r"strategy.fsdp_memory='tiny' is not one of \['fast', 'lean', 'auto'\]"),
        ({"fsdp_memory": "lean"}, r"only data_parallel='fsdp' does: set strategy.data_parallel='fsdp'"),
        ({"fsdp_memory": "auto", "data_parallel": "replicate"}, r"got data_parallel='replicate'"),
        (
            {"fsdp_memory": "lean", "data_parallel": "fsdp", "schedule": "zbv", "stages_per_rank": 2},
            r"fsdp_memory='lean' with strategy.schedule='zbv': a split backward",
        ),
    ],
)
def test_fsdp_memory_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynMoStrategy(**kwargs)
    DynMoStrategy(fsdp_memory="lean", data_parallel="fsdp")  # what it is for


def test_interleaved_schedule_constraints():
    from dynmo_lightning.pipeline.stage.schedules import check_schedule

    with pytest.raises(ValueError, match="interleaved_1f1b' needs at least 2 processes"):
        _fit(tiny_gpt(), DynMoStrategy(schedule="interleaved_1f1b", stages_per_rank=2), _loader())
    with pytest.raises(ValueError, match="stages_per_rank >= 2"):
        check_schedule("interleaved_1f1b", n_ranks=2, n_stages=2, n_microbatches=4)
    with pytest.raises(ValueError, match="must be a multiple of"):
        check_schedule("interleaved_1f1b", n_ranks=4, n_stages=8, n_microbatches=9)
    with pytest.raises(ValueError, match="1F1B needs at least one micro-batch per stage"):
        check_schedule("1f1b", n_ranks=4, n_stages=4, n_microbatches=2)


def test_zero_bubble_schedule_constraints():
    from dynmo_lightning.pipeline.stage.schedules import check_schedule

    # (torch < 2.13 refuses a V on gloo first: test_v_schedules_on_gloo_need_torch_2_13)
    with pytest.raises(ValueError, match="'zbv' needs at least 2 processes" if V_ON_GLOO else "needs torch >= 2.13"):
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
def test_split_backward_refuses_ddp_replicas_only(schedule):
    with pytest.raises(ValueError, match=r"bypasses DDP's gradient averaging.*strategy.data_parallel='fsdp'"):
        DynMoStrategy(schedule=schedule, stages_per_rank=2, data_parallel_size=2)
    for mode in ("fsdp", "replicate"):  # their reduction runs after the weight pass
        DynMoStrategy(schedule=schedule, stages_per_rank=2, data_parallel_size=2, data_parallel=mode)
    DynMoStrategy(schedule=schedule, stages_per_rank=2, activation_checkpointing="all")  # recomputes once for both


def test_accumulate_grad_batches_points_to_microbatches():
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2.*n_microbatches"):
        _fit(tiny_gpt(), DynMoStrategy(n_microbatches=2), _loader(), accumulate_grad_batches=2)


def test_registered_name_works():
    import dynmo_lightning  # noqa: F401

    trainer = L.Trainer(strategy="dynmo", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DynMoStrategy)


def test_hydra_override_typo():
    with (
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"),
        pytest.raises(ConfigCompositionException, match=r"strategy\.schedul"),
    ):
        compose("config", overrides=["strategy.schedul=gpipe", "run_dir=/tmp/x"])


def test_protocol_module_without_training_step():
    class Layers(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, out, y):
            return out.sum()

    with pytest.raises(ProtocolError, match=r"Subclass dynmo_lightning\.PipelineModule"):
        _fit(Layers())


def test_parameters_outside_pipeline_layers():
    class Extra(PipelineModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Embedding(256, 8), nn.Linear(8, 256)])
            self.temperature = nn.Parameter(torch.ones(()))

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, out, y):
            return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ProtocolError, match=r"parameters outside its pipeline_layers\(\): \['temperature'\]"):
        _fit(Extra())


def test_min_stages_above_the_job():
    with pytest.raises(ValueError, match=r"balancer.min_stages=2 > the pipeline's 1 processes"):
        _fit(_gpt(), callbacks=[DynMoBalancer(repack=True, min_stages=2)])


def test_data_parallel_size_not_dividing_the_processes():
    with pytest.raises(ValueError, match=r"strategy.data_parallel_size=2 does not divide the job's 1 processes"):
        _fit(_gpt(), strategy=DynMoStrategy(n_microbatches=2, data_parallel_size=2))


def test_tie_of_parameters_with_different_shapes():
    class Declared(GPT):
        def pipeline_tied_parameters(self):
            return [["blocks.0.mlp.fc.weight", "blocks.1.mlp.proj.weight"]]  # (64, 16) and (16, 64)

    with pytest.raises(TieError, match=r"tied parameters .* have shapes \(64, 16\) and \(16, 64\)"):
        _fit(Declared(n_layer=2, n_embd=16, n_head=2, block_size=32, tie_embeddings=False))


def test_moe_and_sparse_attention_settings():
    with pytest.raises(ValueError, match=r"dynamics.top_k=5 must be between 1 and dynamics.n_experts=4"):
        MixtureOfExperts(n_experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"dynamics.capacity_factor=0 must be > 0"):
        MixtureOfExperts(capacity_factor=0)
    with pytest.raises(ValueError, match=r"model.moe_top_k=3 must be between 1 and model.n_experts=2"):
        GPT(n_experts=2, moe_top_k=3)
    with pytest.raises(ValueError, match=r"block_size=60 is not a multiple of model.attn_block=16"):
        GPT(block_size=60, attention="sparse", attn_block=16)


def test_strategy_and_trace_settings():
    with pytest.raises(ValueError, match=r"strategy.heartbeat_timeout=0 must be > 0"):
        DynMoStrategy(heartbeat_timeout=0)
    with pytest.raises(ValueError, match=r"profile.every_n_steps=0 must be >= 1"):
        CostTrace("/tmp/costs.jsonl", every_n_steps=0)


def test_corrupt_checkpoint(tmp_path):
    path = tmp_path / "broken.ckpt"
    path.write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(ValueError, match=r"broken.ckpt is not a readable checkpoint .* may be truncated"):
        _fit(_gpt(), ckpt_path=str(path))


def test_checkpoint_of_another_model(tmp_path):
    trainer = _fit(_gpt(), default_root_dir=tmp_path)
    path = tmp_path / "small.ckpt"
    trainer.save_checkpoint(path)
    mismatch = r"does not match the model \(size mismatch for embed.wte.weight.*more\). Was it written"
    with pytest.raises(RuntimeError, match=mismatch):
        _fit(GPT(n_layer=2, n_embd=64, n_head=4, block_size=32), ckpt_path=str(path))
    with pytest.raises(RuntimeError, match=r"does not match the model: missing keys \['blocks.2"):
        _fit(GPT(n_layer=3, n_embd=32, n_head=4, block_size=32), ckpt_path=str(path))


def test_v_schedules_on_gloo_need_torch_2_13(monkeypatch):
    """torch 2.11's runtime sends the V's middle stages' shapes from a process to itself, which gloo cannot do."""
    from dynmo_lightning.strategy import checks
    cpu = [torch.device("cpu")]
    if V_ON_GLOO:
        checks.check_v_schedule("zbv", None, cpu)  # this torch (>= 2.13) keeps it local
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.11.0+cu130"))
    with pytest.raises(ValueError, match=r"strategy.schedule='zbv' on gloo needs torch >= 2.13 \(this is 2.11.0"):
        checks.check_v_schedule("zbv", None, cpu)
    checks.check_v_schedule("interleaved_zb", None, cpu)  # looped: no two adjacent stages on one process
    checks.check_v_schedule("dualpipev", None, [torch.device("cuda", 0)])  # NCCL sends to itself
