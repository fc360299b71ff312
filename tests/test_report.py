"""dynmo-report: plots of a training run and of benchmark results, Markdown tables, the console entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bench_data import write_bench_dir

from dynmo_lightning import plots
from dynmo_lightning.bench.page import report_bench
from dynmo_lightning.report import main, plot_run

RUN_PLOTS = {"loss.png", "stage_load.png", "partitions.png", "world_size.png"}


@pytest.fixture(autouse=True)
def _low_dpi(monkeypatch):
    # The tests check which files appear, not how they look: small images keep them fast.
    monkeypatch.setattr(plots, "DPI", 40)


def _summary(steps: int = 12) -> dict:
    return {
        "steps": steps,
        "losses": [5.0 - 0.2 * i for i in range(steps)],
        "final_loss": 5.0 - 0.2 * (steps - 1),
        "val_loss": 3.1,
        "tokens_per_s": 1234.5,
        "world_size_start": 4,
        "world_size_end": 2,
        "world_size": [{"step": 0, "world_size": 4}, {"step": 8, "world_size": 2}],
        "partitions": [
            {"step": 0, "layers_per_stage": [2, 2, 2, 2]},
            {"step": 4, "layers_per_stage": [3, 2, 2, 1]},
            {"step": 8, "layers_per_stage": [5, 3]},
        ],
        "param_norm": 12.3,
    }


def _cost_record(step: int, layers_per_stage: list[int]) -> dict:
    n = sum(layers_per_stage)
    # Front layers get cheaper over time, as under freezing.
    fwd = [0.001 * (1 + i) / (1 + step * (i < 4)) for i in range(n)]
    return {
        "step": step,
        "fwd": fwd,
        "bwd": [2 * f for f in fwd],
        "activation_bytes": [1024] * n,
        "param_bytes": [4096] * n,
        "grad_bytes": [4096] * n,
        "optim_bytes": [8192] * n,
        "layers_per_stage": layers_per_stage,
        "world_size": len(layers_per_stage),
    }


def _write_run(path: Path, *, optional: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "summary.json").write_text(json.dumps(_summary()))
    if optional:
        splits = {0: [2, 2, 2, 2], 4: [3, 2, 2, 1], 8: [5, 3]}
        records = [_cost_record(s, splits[max(k for k in splits if k <= s)]) for s in range(0, 12, 2)]
        # A partial last line, as a run killed mid-write leaves it, must not stop the plot.
        (path / "costs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 12, "fw')
        (path / "csv").mkdir()
        (path / "csv" / "metrics.csv").write_text(
            "balancer/world_size,freezing/frozen_layers,epoch,step,train_loss,val_loss,val_ppl\n"
            "4,,0,4,4.2,,\n"
            ",0.25,0,5,,3.9,49.4\n"
            "2,,0,9,3.3,,\n"
            ",0.5,0,11,,3.1,22.2\n"
        )
    return path


def _names(paths: list[Path]) -> set[str]:
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    return {p.name for p in paths}


def test_plot_run_with_optional_files(tmp_path):
    run = _write_run(tmp_path / "run", optional=True)
    paths = plot_run(run)
    assert _names(paths) == RUN_PLOTS
    assert all(p.parent == run / "plots" for p in paths)


def test_plot_run_without_optional_files_skips_stage_loads(tmp_path):
    run = _write_run(tmp_path / "run", optional=False)
    paths = plot_run(run, tmp_path / "out")
    assert _names(paths) == RUN_PLOTS - {"stage_load.png"}
    assert all(p.parent == tmp_path / "out" for p in paths)


def test_plot_run_minimal_summary(tmp_path):
    # A run without losses, partitions or world-size log (e.g. zero steps) yields no plots rather than an error.
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 0, "losses": [], "val_loss": None, "partitions": []}))
    (tmp_path / "costs.jsonl").write_text('{"step": 0, "fwd": [1.0], "bwd": [1.0], "layers_per_stage": [2]}\n')
    assert plot_run(tmp_path) == []


def test_plot_run_needs_summary(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"summary\.json"):
        plot_run(tmp_path)


def test_report_bench(tmp_path):
    d = write_bench_dir(tmp_path / "bench")
    names = _names(report_bench(d))
    assert names == {"speedup.png", "sweeps.png", "real.png", "stage_loads_none_P4.png", "stage_loads_freezing_P4.png"}
    md = (d / "benchmarks.md").read_text()
    sections = ("## DynMo at scale", "### Strength sweeps", "### Migration bandwidth", "### Consolidation",
                "## Real A/B on this machine", "## Layer costs at LLM size", "## Plots")  # fmt: skip
    assert all(section in md for section in sections)
    assert "test-cpu" in md and "![speedup](plots/speedup.png)" in md
    # The headline is DynMo's own policy, in bold, beside the oracle and the seed's figure.
    sim = json.loads((d / "simulated.json").read_text())
    cmp = sim["dynamics"]["freezing"]["by_stages"]["4"]
    optimal = cmp["policies"]["optimal"]
    row = next(line for line in md.splitlines() if line.startswith("| freezing (0.5) | 4 |"))
    assert f"**{optimal['speedup']:.2f}\u00d7** ({100 * optimal['share_of_oracle']:.0f} %)" in row
    assert f"| {cmp['oracle']['speedup']:.2f}\u00d7 |" in row and row.endswith("| 2.23\u00d7 |")
    # Real A/B: the paired ratio with its 95 % interval, the ideal ratio and the reaction lag of 2 steps.
    real = next(r for r in json.loads((d / "real.json").read_text())["rows"] if r["policy"] == "optimal")
    row = next(line for line in md.splitlines() if line.startswith("| freezing | 105 | DynMo | 122 |"))
    assert f"**{real['ratio']:.2f}\u00d7** [{real['ratio_low']:.3f}, {real['ratio_high']:.3f}]" in row
    assert "2 steps (0.4 profile intervals; moves after 6 of 6 events)" in row
    # The sweep names where the seed's figure is (or is not) reached.
    assert "**freezing** (AutoFreeze (growing frozen prefix)): the oracle " in md


def test_report_bench_partial(tmp_path):
    # Only the layer costs: the report has their table and no plots; nothing else is attempted.
    d = write_bench_dir(tmp_path / "bench")
    (d / "real.json").unlink()
    (d / "simulated.json").unlink()
    assert report_bench(d) == []
    md = (d / "benchmarks.md").read_text()
    assert "## Layer costs at LLM size" in md and "## Real A/B" not in md


def test_main_run_dir(tmp_path, capsys):
    run = _write_run(tmp_path / "run", optional=True)
    main([str(run)])
    printed = capsys.readouterr().out.split()
    assert {Path(p).name for p in printed} == RUN_PLOTS
    main([str(run), "--out", str(tmp_path / "elsewhere")])
    assert (tmp_path / "elsewhere" / "loss.png").is_file()


def test_main_bench_dir(tmp_path, capsys):
    d = write_bench_dir(tmp_path)
    main([str(d)])
    printed = [Path(p) for p in capsys.readouterr().out.split()]
    assert d / "benchmarks.md" in printed and d / "plots" / "speedup.png" in printed
    assert "## DynMo at scale" in (d / "benchmarks.md").read_text()


def test_main_rejects_other_dirs(tmp_path):
    with pytest.raises(SystemExit, match=r"neither summary\.json .* nor the results of dynmo-bench"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="neither"):
        main([str(tmp_path / "missing")])
