"""Evaluation under the pipeline: a classifier (not a language model) validates and tests with its own torchmetrics
``Accuracy`` through ``pipeline_eval_step``, equal to its ``validation_step``/``test_step`` under plain single-device
Lightning, at P = 1, 2, 4, the same on every process; perplexity only for token targets; a module whose evaluation
steps the pipeline would skip is refused before launch."""

from __future__ import annotations

import json
import sys

import pytest
from support import SUPPORT
from support.classifier_model import Classifier, loader, run
from support.helpers import launch_script

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.protocol import ProtocolError
from dynmo_lightning.strategy.checks import check_model

SCRIPT = SUPPORT / "_classifier_script.py"


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    return run()  # plain single-device Lightning: the module's own validation_step and test_step


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[int, list[dict[str, float]]]:
    out: dict[int, list[dict[str, float]]] = {1: [run(DynMoStrategy(n_microbatches=4))]}
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"classifier-p{world}")
        launch_script(world, SCRIPT, str(d), log_dir=d / "logs", timeout=600)
        out[world] = [json.loads((d / f"metrics.rank{r}.json").read_text()) for r in range(world)]
    return out


def test_the_reference_logs_what_the_test_compares(reference):
    assert set(reference) == {f"{p}{s}_{m}" for p, s in (("fit/", "val"), ("", "val"), ("", "test"))
                              for m in ("loss", "acc", "confidence")}  # fmt: skip
    assert not any("ppl" in k for k in reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_classifier_validates_and_tests_as_on_one_device(reference, pipelines, world):
    for rank, metrics in enumerate(pipelines[world]):
        assert metrics.keys() == reference.keys(), (rank, sorted(metrics))  # no perplexity for class labels
        for key, value in reference.items():
            if key.endswith("_acc"):
                assert metrics[key] == value, (rank, key)  # counts: exact
            else:
                assert metrics[key] == pytest.approx(value, rel=1e-5), (rank, key)


class _Skipped(Classifier):
    pipeline_eval_step = None  # type: ignore[assignment]  # validation_step and test_step, and no hook


def test_evaluation_steps_without_the_hook_are_refused_before_launch():
    with pytest.raises(ProtocolError, match=r"_Skipped defines validation_step, which DynMoStrategy never calls"):
        check_model(_Skipped())


def test_the_refusal_comes_from_the_launching_process():
    import lightning.pytorch as L

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DynMoStrategy(n_microbatches=4), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    with pytest.raises(ProtocolError, match="pipeline_eval_step"):
        trainer.fit(_Skipped(), loader("train"))
    assert "torch.distributed" not in sys.modules or not __import__("torch").distributed.is_initialized()
