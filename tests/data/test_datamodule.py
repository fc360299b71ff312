from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch import Tensor, nn

from dynmo_lightning.data import StdlibCharDataModule, build_corpus, decode

SMALL = {"block_size": 16, "batch_size": 4, "max_bytes": 20_000, "val_fraction": 0.1}


def _ready(**kwargs: object) -> StdlibCharDataModule:
    dm = StdlibCharDataModule(**{**SMALL, **kwargs})  # type: ignore[arg-type]
    dm.setup("fit")
    return dm


def _train_order(dm: StdlibCharDataModule) -> list[Tensor]:
    return [x for x, _ in dm.train_dataloader()]


def test_split_is_the_corpus_tail_by_position() -> None:
    dm = _ready()
    corpus = torch.frombuffer(bytearray(build_corpus(20_000)), dtype=torch.uint8)
    assert dm.train_dataset is not None and dm.val_dataset is not None
    assert dm.train_dataset.tokens.numel() == 18_000
    assert dm.val_dataset.tokens.numel() == 2_000
    assert torch.equal(dm.train_dataset.tokens, corpus[:18_000])
    assert torch.equal(dm.val_dataset.tokens, corpus[18_000:])
    assert len(dm.train_dataset) == (18_000 - 1) // 16
    assert len(dm.val_dataset) == (2_000 - 1) // 16


def test_batches_have_the_right_shape_and_shift() -> None:
    dm = _ready()
    assert dm.vocab_size == 256
    assert dm.tokens_per_batch == 64
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        x, y = next(iter(loader))
        assert x.shape == y.shape == (4, 16)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert decode(x[0])  # printable sample


def test_drop_last_keeps_only_full_batches() -> None:
    dm = _ready()
    assert dm.train_dataset is not None and dm.val_dataset is not None
    # 1124 train windows / 4 = 281 full batches; 124 val windows / 4 = 31.
    for loader, n_windows in ((dm.train_dataloader(), 1124), (dm.val_dataloader(), 124)):
        assert len(loader) == n_windows // 4
        batches = list(loader)
        assert len(batches) == n_windows // 4
        assert all(x.shape[0] == 4 for x, _ in batches)

    odd = _ready(batch_size=5)  # 1124 and 124 are not multiples of 5: the rest is dropped
    assert len(list(odd.train_dataloader())) == 1124 // 5
    assert len(list(odd.val_dataloader())) == 124 // 5


def test_validation_is_in_stream_order_and_can_be_capped() -> None:
    dm = _ready()
    assert dm.val_dataset is not None
    x, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(x, dm.val_dataset.tokens[:64].view(4, 16).long())

    capped = _ready(max_val_batches=3)
    batches = list(capped.val_dataloader())
    assert len(batches) == 3
    assert torch.equal(batches[0][0], x)
    assert capped.train_dataset is not None and dm.train_dataset is not None
    assert torch.equal(capped.train_dataset.tokens, dm.train_dataset.tokens)
    assert len(list(_ready(max_val_batches=10_000).val_dataloader())) == 31  # a cap above the split changes nothing


def test_seeded_shuffle_repeats_and_differs_by_seed() -> None:
    dm = _ready(seed=7)
    first = _train_order(dm)
    assert all(torch.equal(a, b) for a, b in zip(first, _train_order(dm), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, _train_order(_ready(seed=7)), strict=True))
    other = _train_order(_ready(seed=8))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    # It is a permutation of the windows, not a resampling.
    assert torch.equal(torch.cat(first).sort(dim=0).values, torch.cat(other).sort(dim=0).values)
    in_order = torch.stack([dm.train_dataset[i][0] for i in range(len(first) * 4)])  # type: ignore[index]
    assert not torch.equal(torch.cat(first), in_order)


def test_setup_is_idempotent() -> None:
    dm = _ready()
    dataset = dm.train_dataset
    dm.setup("validate")
    assert dm.train_dataset is dataset


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, r"block_size=0 must be at least 1"),
        ({"batch_size": 0}, r"batch_size=0 must be at least 1"),
        ({"val_fraction": 0.0}, r"val_fraction=0.0 must lie strictly between 0 and 1"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 must lie strictly between 0 and 1"),
        ({"num_workers": -1}, r"num_workers=-1 must be 0"),
        ({"max_val_batches": 0}, r"max_val_batches=0 must be at least 1"),
        (
            {"max_bytes": 600},
            r"max_bytes=600\) is too small: batch_size=4 x block_size=16 with val_fraction=0.1 needs at least 650 "
            r"bytes .* Raise max_bytes to 650 or more, or lower block_size/batch_size",
        ),
    ],
)
def test_bad_settings_fail_at_construction(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StdlibCharDataModule(**{**SMALL, **kwargs})  # type: ignore[arg-type]


def test_minimum_corpus_size_is_exact() -> None:
    # 65 tokens per split (4 x 16 + 1); val_fraction=0.1 puts floor(n / 10) tokens in validation.
    with pytest.raises(ValueError, match="needs at least 650 bytes"):
        StdlibCharDataModule(**{**SMALL, "max_bytes": 649})  # type: ignore[arg-type]
    dm = _ready(max_bytes=650)
    assert len(dm.val_dataloader()) == 1  # 65 validation tokens: exactly one batch of 4 windows
    assert len(dm.train_dataloader()) == (585 - 1) // 16 // 4
    # The default settings must fit the default corpus cap.
    StdlibCharDataModule()


def test_sources_smaller_than_max_bytes_fail_in_setup(tmp_path: Path) -> None:
    (tmp_path / "only.py").write_text("x = 1\n" * 50)
    dm = StdlibCharDataModule(**{**SMALL, "root": tmp_path})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"only 300 bytes of sources\) is too small.*needs at least 650 bytes"):
        dm.setup("fit")


def test_dataloader_before_setup_explains_itself() -> None:
    with pytest.raises(RuntimeError, match=r"setup\(\) must run before"):
        StdlibCharDataModule(**SMALL).train_dataloader()  # type: ignore[arg-type]


class _Bigram(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)
        self.shapes: list[tuple[int, ...]] = []

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        self.shapes.append(tuple(x.shape))
        return nn.functional.cross_entropy(self.table(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_runs_with_the_datamodule(tmp_path: Path) -> None:
    dm = StdlibCharDataModule(**{**SMALL, "max_val_batches": 2})  # type: ignore[arg-type]
    model = _Bigram()
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=3,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert model.shapes == [(4, 16)] * 5  # 3 training steps, then 2 capped validation batches
    assert dm.hparams["block_size"] == 16


def test_arguments_are_attributes_and_a_subclass_keeps_its_own() -> None:
    class WithOwn(StdlibCharDataModule):
        def __init__(self, extra: int = 3, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]

        @property
        def extra(self) -> str:  # read-only: the base must not assign it
            return "own"

    dm = WithOwn(extra=5, batch_size=4, block_size=8, seed=3)
    assert (dm.batch_size, dm.block_size, dm.seed, dm.root, dm.max_val_batches) == (4, 8, 3, None, None)
    assert dm.extra == "own" and dm.hparams["extra"] == 5
