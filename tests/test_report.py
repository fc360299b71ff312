"""dynmo-report: plots of a training run and of benchmark results, Markdown tables, the console entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynmo_lightning import report
from dynmo_lightning.report import main, markdown_table, plot_bench, plot_run

SEED = {"moe": 1.23, "pruning": 3.18, "freezing": 2.23, "sparse_attention": 4.02, "early_exit": 4.52, "mod": 1.17}
RUN_PLOTS = {"loss.png", "stage_load.png", "partitions.png", "world_size.png"}


@pytest.fixture(autouse=True)
def _low_dpi(monkeypatch):
    # The tests check which files appear, not how they look: small images keep them fast.
    monkeypatch.setattr(report, "DPI", 40)


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
            "balancer/world_size,dynamics/frozen,epoch,step,train_loss,val_loss,val_ppl\n"
            "4,,0,4,4.2,,\n"
            ",0.25,0,5,,3.9,49.4\n"
            "2,,0,9,3.3,,\n"
            ",0.5,0,11,,3.1,22.2\n"
        )
    return path


def _sim_entry(dynamic: str, p: int, policy: str, speedup: float) -> dict:
    steps = [0, 5, 10]
    shrink = policy == "optimal+repack"
    balanced = policy != "uniform"
    loads = [[1.0] * p, [0.9] * p if balanced else [0.2] + [1.0] * (p - 1), [1.0] * (p // 2 if shrink else p)]
    return {
        "dynamic": dynamic,
        "n_stages": p,
        "policy": policy,
        "total_time": 10.0 / speedup,
        "speedup_over_uniform": speedup,
        "speedup_over_params": speedup / 1.1,
        "rank_seconds": 40.0 / speedup,
        "rank_seconds_saved": 0.375 if shrink else None,
        "imbalance": [1.0, 1.0 if balanced else 1.3, 1.05],
        "steps": steps,
        "stage_loads": loads,
        "partitions": [
            {"step": 0, "layers_per_stage": [2] * p},
            {"step": 5, "layers_per_stage": [3] + [2] * (p - 2) + [1]},
        ],
        "world_sizes": [{"step": 0, "world_size": p}] + ([{"step": 10, "world_size": p // 2}] if shrink else []),
    }


@pytest.fixture(scope="module")
def results() -> dict:
    dynamics = ["freezing", "early_exit"]
    policies = {"uniform": 1.0, "params": 1.1, "optimal": 1.8, "diffusion": 1.7, "optimal+repack": 1.6}
    return {
        "config": {"steps": 10, "n_layers": 8},
        "machine": {"cpu": "test-cpu", "torch": "2.13.0", "lightning": "2.6.6"},
        "seed": SEED,
        "real": [
            {
                "dynamic": d,
                "policy": policy,
                "tokens_per_s": [1000.0 * r, 1010.0 * r],
                "mean_tokens_per_s": 1005.0 * r,
                "ratio_to_uniform": r,
                "ideal_ratio": None if policy == "uniform" else 1.9,
            }
            for d in dynamics
            for policy, r in (("uniform", 1.0), ("optimal", 1.42))
        ],
        "simulated": [_sim_entry(d, p, policy, s) for d in dynamics for p in (2, 4) for policy, s in policies.items()],
    }


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


def test_plot_bench(tmp_path, results):
    names = _names(plot_bench(results, tmp_path))
    assert names == {
        "speedup.png",
        "world_size_P4.png",
        *(
            f"{kind}_{d}_P4.png"
            for kind in ("stage_load", "partitions", "imbalance")
            for d in ("freezing", "early_exit")
        ),
    }


def test_plot_bench_partial_results(tmp_path):
    # Only the seed figures: the bar chart still draws, nothing per dynamic is attempted.
    partial = {"seed": SEED, "real": [], "simulated": []}
    assert _names(plot_bench(partial, tmp_path)) == {"speedup.png"}
    assert plot_bench({}, tmp_path / "empty") == []


def test_markdown_table(results):
    md = markdown_table(results)
    for section in ("## Real runs", "## Simulated runs", "## Summary against the seed"):
        assert section in md
    for word in ("freezing", "early_exit", "uniform", "params", "optimal", "diffusion", "optimal+repack", "test-cpu"):
        assert word in md
    # Seed figures, best simulated speed-up with its policy and P, ratios with two decimals, saved share in percent.
    assert "| freezing | 1.42\u00d7 (optimal) | 1.80\u00d7 (optimal, P=2) | 2.23\u00d7 | 0.81 |" in md
    for figure in ("1.23\u00d7", "3.18\u00d7", "4.02\u00d7", "4.52\u00d7", "1.17\u00d7"):
        assert figure in md
    assert "| early_exit | 4 | optimal+repack | 1.60\u00d7 | 1.45\u00d7 | 37.5% |" in md
    assert "1,005 ± 7 (n=2)" in md


def test_main_run_dir(tmp_path, capsys):
    run = _write_run(tmp_path / "run", optional=True)
    main([str(run)])
    printed = capsys.readouterr().out.split()
    assert {Path(p).name for p in printed} == RUN_PLOTS
    main([str(run), "--out", str(tmp_path / "elsewhere")])
    assert (tmp_path / "elsewhere" / "loss.png").is_file()


def test_main_bench_dir(tmp_path, capsys, results):
    (tmp_path / "results.json").write_text(json.dumps(results))
    main([str(tmp_path), "--stages", "2"])
    printed = [Path(p) for p in capsys.readouterr().out.split()]
    md = tmp_path / "benchmarks.md"
    assert md in printed and (tmp_path / "plots" / "speedup.png") in printed
    text = md.read_text()
    assert "## Simulated runs" in text
    assert "![speedup](plots/speedup.png)" in text
    assert "(plots/stage_load_freezing_P2.png)" in text


def test_main_rejects_other_dirs(tmp_path):
    with pytest.raises(SystemExit, match=r"neither summary\.json .* nor results\.json"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="neither"):
        main([str(tmp_path / "missing")])
