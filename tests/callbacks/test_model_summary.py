"""The model summary under DynMoStrategy describes the whole model (issue 36, item 2), not global rank 0's stage.

The README's example on 4 processes (8 layers, 33.3 K parameters; layer 1 frozen here): at P = 4 under Lightning's
default (rich) summary and under an explicit plain ``ModelSummary`` with a weight tied across stages 0 and 3; two
replicas of P = 2 under ``data_parallel="fsdp"`` (each process holds half of every layer); P = 4 repacked onto two
ranks. The totals equal Lightning's summary of the unsplit model at fit start and after the migration or repack,
and the printed table has a row per stage.
"""

from __future__ import annotations

import json

import pytest
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from support import SUPPORT
from support._summary_script import CASES, ReadmeNet
from support.helpers import launch_script

from dynmo_lightning.callbacks.model_summary import PipelineModelSummary, PipelineRichModelSummary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("summary")
    launch_script(4, SUPPORT / "_summary_script.py", str(d), *CASES, log_dir=d / "logs")  # "shrink" last
    return {case: json.loads((d / f"{case}.json").read_text()) for case in CASES}


def _whole(model) -> dict:
    """Lightning's own summary of the unsplit model: what the pipeline's must say."""
    s = summarize(model, max_depth=1)
    return {
        "total_parameters": s.total_parameters,
        "trainable_parameters": s.trainable_parameters,
        "model_size": s.model_size,
        "training_modes": s.total_training_modes,
    }


def _initial(case: str) -> list[int]:
    """The uniform split the case starts from: two stages under fsdp (two replicas of them), else four."""
    return [4, 4] if case == "fsdp" else [2, 2, 2, 2]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_the_summary_totals_are_the_unsplit_models_before_and_after_a_migration_or_repack(runs, case):
    run, whole = runs[case], _whole(ReadmeNet(tied=case == "tied"))
    assert whole["total_parameters"] == (29_184 if case == "tied" else 33_280)
    assert whole["trainable_parameters"] == whole["total_parameters"] - 4_160  # layer 1 frozen
    expected = "PipelineModelSummary" if case == "tied" else "PipelineRichModelSummary"
    assert run["callback"] == [expected]  # swapped in for Lightning's at set-up, settings kept
    for when, split in (("before", _initial(case)), ("after", CASES[case][1])):
        summary = run[when]
        assert summary["model_size"] == pytest.approx(whole["model_size"]), when
        counts = ("total_parameters", "trainable_parameters", "training_modes")
        assert [summary[k] for k in counts] == [whole[k] for k in counts], when
        stages = summary["stages"]
        assert [len(r["layers"]) for r in stages] == split and [r["rank"] for r in stages] == list(range(len(split)))
        assert [r["device"] for r in stages] == ["cpu"] * len(split)
        assert [r["params"] for r in stages] == [4_160 * n for n in split]  # the tied copy counts on its stage too
        frozen = [4_160 if 1 in r["layers"] else 0 for r in stages]
        assert [r["trainable"] for r in stages] == [r["params"] - f for r, f in zip(stages, frozen, strict=True)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_the_printed_summary_shows_the_whole_model_and_a_row_per_stage(runs, case):
    run = runs[case]
    total = get_human_readable_count(run["before"]["total_parameters"])
    for when, text, split in (
        ("fit start", run["fit_start_text"], _initial(case)),
        ("again", run["again_text"], CASES[case][1]),
    ):
        assert "8.3 K" not in text.split("Trainable")[-1], (when, text)  # the totals are not stage 0's
        assert total in text and ("Total params" if case == "tied" else "Total params: ") in text, (when, text)
        rows = [line for line in text.splitlines() if "cpu" in line]
        assert len(rows) == len(split), (when, text)
        assert [r for r in rows if f"({split[-1]})" in r], (when, text)  # the last stage's layer count


def test_lightnings_own_summaries_are_swapped_and_users_subclasses_kept():
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    from dynmo_lightning.callbacks.model_summary import use_pipeline_summaries

    class Mine(ModelSummary):
        pass

    mine = Mine()
    callbacks = [ModelSummary(max_depth=3, foo=1), RichModelSummary(header_style="bold"), mine]
    use_pipeline_summaries(callbacks)
    plain, rich, kept = callbacks
    assert type(plain) is PipelineModelSummary and plain._max_depth == 3 and plain._summarize_kwargs == {"foo": 1}
    assert type(rich) is PipelineRichModelSummary and rich._summarize_kwargs == {"header_style": "bold"}
    assert kept is mine
