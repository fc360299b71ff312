"""The straggler A/B: its cases and their alternation, the summary's math, the straggler and the window's samples."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynmo_lightning.bench import real, straggler_real
from dynmo_lightning.bench.faults import SlowProcess
from dynmo_lightning.bench.real import Window, WindowCosts, ideal_makespans, interval95
from dynmo_lightning.bench.straggler_real import (
    build_cases,
    case_specs,
    check_spec,
    parse_args,
    real_config,
    speed_ideal,
    summarize,
)
from dynmo_lightning.callbacks import TokenEarlyExit

pytestmark = pytest.mark.timeout(120)

LINK = {"p2p_latency_s": 0.0, "p2p_bytes": 0, "p2p_bytes_per_s": 1.0}
#: Four equal layers at the reference speed (forward 1, backward 2 per micro-batch).
COSTS = {"fwd": [1.0] * 4, "bwd": [2.0] * 4, "wgt": [0.0] * 4}


def _cases(tmp_path: Path, labels: list[str], repeats: int = 2, argv: list[str] | None = None) -> list[dict[str, Any]]:
    specs = case_specs(parse_args(argv or []))
    return build_cases(real_config([]), tmp_path, specs, labels, repeats)


def test_policies_alternate_within_every_repeat(tmp_path: Path) -> None:
    cases = _cases(tmp_path, ["steady", "intermittent"])
    order = [(c["repeat"], c["case"], c["policy"]) for c in cases]
    policies = ("uniform", "static_time", "optimal")
    assert order == [(r, k, p) for r in range(2) for k in ("steady", "intermittent") for p in policies]
    steady, inter = cases[0], cases[3]
    assert steady["straggler"] == "1:1.5:20" and inter["straggler"] == "1:1.5:20:intermittent:20"
    # the steady window starts after DynMo's reaction; the intermittent one at the onset, whole cycles to the end
    assert (steady["steps"], steady["measure_from"]) == (60, 30) and (inter["steps"], inter["measure_from"]) == (60, 20)
    assert all(c["dynamic"] == "none" and c["world_size"] == 2 and c["microbatches"] == 8 for c in cases)
    # static_time plans at the first check, before the straggler appears at step 20
    assert all(c["balancer"]["every_n_steps"] == 10 for c in cases)
    assert len({c["name"] for c in cases}) == len(cases) == len({c["result"] for c in cases})
    assert cases[-1]["name"] == "intermittent-optimal-1"
    assert Path(cases[-1]["result"]) == tmp_path / "straggler_real" / "intermittent-optimal-1.json"


def test_early_exit_case_ramps_after_the_first_check(tmp_path: Path) -> None:
    case = _cases(tmp_path, ["early_exit_late"], repeats=1)[0]
    assert case["dynamic"] == "early_exit" and not case["straggler"]
    assert case["preset"] == {"warmup_steps": 20, "ramp_steps": 15}
    assert case["measure_from"] >= case["preset"]["warmup_steps"] + case["preset"]["ramp_steps"]
    assert case["preset"]["warmup_steps"] > case["balancer"]["every_n_steps"]
    exits = real.real_preset(case["dynamic"], 12, case["preset"])
    assert isinstance(exits, TokenEarlyExit)
    assert exits.threshold_at(19) > 1.0 and exits.threshold_at(35) == pytest.approx(0.9)
    # the committed preset is untouched
    assert real.real_preset("early_exit", 12).settings.warmup_steps == 5


def test_windows_must_follow_the_onset_and_cover_whole_cycles() -> None:
    check_spec("a", {"steps": 60, "measure_from": 20, "straggler": "1:1.5:20:intermittent:20"})
    with pytest.raises(ValueError, match="whole slow-and-fast cycles"):
        check_spec("a", {"steps": 70, "measure_from": 20, "straggler": "1:1.5:20:intermittent:20"})
    with pytest.raises(ValueError, match="whole slow-and-fast cycles"):
        check_spec("a", {"steps": 70, "measure_from": 30, "straggler": "1:1.5:20:intermittent:20"})
    with pytest.raises(ValueError, match="before the straggler"):
        check_spec("a", {"steps": 60, "measure_from": 10, "straggler": "1:1.5:20"})
    with pytest.raises(ValueError, match="must lie in"):
        check_spec("a", {"steps": 60, "measure_from": 60})


def test_a_straggler_case_gets_a_slow_process() -> None:
    case = {"dynamic": "none", "policy": "uniform", "straggler": "1:1.5:20:intermittent:10", "measure_from": 0}
    callbacks, balancer, _ = real._case_callbacks(case, Window(0), 12)
    slow = [c for c in callbacks if isinstance(c, SlowProcess)]
    assert balancer is None and len(slow) == 1
    assert (slow[0].rank, slow[0].slowdown.factor, slow[0].from_step) == (1, 1.5, 20)
    assert (slow[0].pattern, slow[0].period) == ("intermittent", 10)
    for plain in ({**case, "straggler": None}, {k: v for k, v in case.items() if k != "straggler"}):
        assert not any(isinstance(c, SlowProcess) for c in real._case_callbacks(plain, Window(0), 12)[0])


def _sample(fwd: float, probes: tuple[float, float]) -> dict[int, dict[str, float]]:
    """A profiled step of two layers, one per rank, each process with its kernel time."""
    return {i: {"fwd": fwd / probes[0] * probes[i], "bwd": 0.0, "probe_s": probes[i], "pp_rank": float(i)}
            for i in range(2)}  # fmt: skip


def test_window_keeps_its_own_profiles_normalised_with_their_speeds() -> None:
    speeds = SimpleNamespace(in_force=[1.0, 0.5])
    balancer = SimpleNamespace(last_measured=None, policy=SimpleNamespace(speeds=speeds))
    costs = WindowCosts(balancer, start=10)  # type: ignore[arg-type]

    def step(done: int, measured: dict | None) -> None:
        if measured is not None:
            balancer.last_measured = measured
        costs.on_train_batch_end(SimpleNamespace(global_step=done), None, None, None, 0)  # type: ignore[arg-type]

    step(5, _sample(1.0, (1.0, 1.0)))  # before the window
    step(11, None)  # a one-shot policy's last profile is older than the window: no sample of it
    assert costs.samples == []
    step(12, _sample(1.0, (1.0, 2.0)))  # rank 1 twice as slow: its layer took 2 as measured
    step(13, None)  # not profiled: the same measurement is not counted twice
    assert len(costs.samples) == 1 and costs.in_force == [[1.0, 0.5]]
    assert costs.mean()["fwd"] == [1.0, 2.0]
    assert costs.mean(normalised=True)["fwd"] == [1.0, 1.0]
    assert costs.speeds() == [[1.0, 0.5]]


def _results(tokens: dict[str, list[float]], optimal_extra: dict[str, Any]) -> tuple[list, dict]:
    cases, results = [], {}
    for repeat in range(len(tokens["uniform"])):
        for policy in ("uniform", "static_time", "optimal"):
            name = f"steady-{policy}-{repeat}"
            cases.append({"name": name, "case": "steady", "policy": policy, "repeat": repeat, "world_size": 2,
                          "microbatches": 4})  # fmt: skip
            results[name] = {"tokens_per_s": tokens[policy][repeat], "val_loss": 2.0, "moves": []}
            if policy == "optimal":
                results[name] |= optimal_extra
    return cases, results


def test_summary_pairs_by_repeat_and_takes_the_share_of_the_ideal() -> None:
    tokens = {"uniform": [100.0, 90.0, 110.0], "static_time": [101.0, 92.0, 108.0], "optimal": [120.0, 117.0, 121.0]}
    speeds = [[1.0, 0.5]] * 4
    cases, results = _results(tokens, {"window_costs_normalised": COSTS, "window_speeds": speeds,
                                       "window_costs": {**COSTS, "fwd": [9.0] * 4}})  # fmt: skip
    rows = {r["policy"]: r for r in summarize(cases, results, LINK)}
    assert [r["policy"] for r in summarize(cases, results, LINK)] == ["uniform", "static_time", "optimal"]
    dynmo = rows["optimal"]
    ratios = [120 / 100, 117 / 90, 121 / 110]
    mean, low, high = interval95(ratios)
    assert dynmo["ratios"] == pytest.approx(ratios)
    assert dynmo["over_uniform"] == pytest.approx(mean) and dynmo["ci95"] == pytest.approx([low, high])
    # the ideal: uniform split over best split, the costs at the reference speed and rank 1 at half speed
    uniform, best = ideal_makespans(COSTS, 2, 4, 0.0, speeds=[1.0, 0.5])
    assert uniform / best > 1.2
    assert dynmo["ideal_ratio"] == pytest.approx(uniform / best)
    assert dynmo["share_of_ideal"] == pytest.approx(mean / (uniform / best))
    assert dynmo["mean_speeds"] == pytest.approx([1.0, 0.5])
    over_static = [120 / 101, 117 / 92, 121 / 108]
    assert dynmo["over_static_time"]["ratios"] == pytest.approx(over_static)
    assert dynmo["over_static_time"]["mean"] == pytest.approx(statistics.fmean(over_static))
    assert rows["uniform"]["over_uniform"] == 1.0 and rows["uniform"]["ratios"] == [1.0] * 3
    assert rows["static_time"]["share_of_ideal"] == pytest.approx(rows["static_time"]["over_uniform"] * best / uniform)
    assert "over_static_time" not in rows["static_time"]
    # a repeat missing its uniform run is not paired
    del results["steady-uniform-2"]
    partial = [c for c in cases if c["name"] != "steady-uniform-2"]
    assert {r["policy"]: r for r in summarize(partial, results, LINK)}["optimal"]["ratios"] == pytest.approx(ratios[:2])


def test_intermittent_ideal_weighs_slow_and_fast_phases_by_their_samples() -> None:
    slow, fast, noise = [1.0, 0.5], [1.0, 1.0], [0.97, 1.0]
    run = {"window_costs_normalised": COSTS, "window_speeds": [slow, slow, fast, noise]}
    u_slow, b_slow = ideal_makespans(COSTS, 2, 4, 0.0, speeds=slow)
    u_fast, b_fast = ideal_makespans(COSTS, 2, 4, 0.0)
    expected = (2 * u_slow + 2 * u_fast) / (2 * b_slow + 2 * b_fast)  # the noisy sample counts as alike
    assert speed_ideal(run, {"world_size": 2, "microbatches": 4}, 0.0) == pytest.approx(expected)
    assert u_fast == pytest.approx(b_fast)  # equal layers, equal speeds: uniform is best
    assert speed_ideal({"window_costs": None}, {"world_size": 2, "microbatches": 4}, 0.0) is None


def test_main_writes_the_json_and_keeps_other_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[list[str]] = []

    def fake_launch(world_size: int, cases: list, out: Path, timeout: float, link: dict | None, stem: str) -> None:
        launched.append([c["name"] for c in cases])
        for c in cases:
            speed = {"uniform": 100.0, "static_time": 105.0, "optimal": 125.0}[c["policy"]]
            result = {"tokens_per_s": speed, "val_loss": 2.0, "moves": [24] if c["policy"] == "optimal" else []}
            if c["policy"] == "optimal":
                result |= {"window_costs_normalised": COSTS, "window_speeds": [[1.0, 0.6]]}
            Path(c["result"]).write_text(json.dumps(result))
        if link is not None:
            Path(link["result"]).write_text(json.dumps(LINK))

    monkeypatch.setattr("dynmo_lightning.bench.main._launch", fake_launch)
    rows = straggler_real.main(["--out", str(tmp_path), "--repeats", "2"])
    assert len(launched[0]) == 12
    assert [(r["case"], r["policy"]) for r in rows][:3] == [("steady", p) for p in straggler_real.POLICIES]
    # the early-exit A/B joins the same file; the straggler rows stay, their results are not run again
    straggler_real.main(["--out", str(tmp_path), "--repeats", "2", "--early-exit"])
    assert launched[1] == [f"early_exit_late-{p}-{r}" for r in range(2) for p in straggler_real.POLICIES]
    data = json.loads((tmp_path / "straggler_real.json").read_text())
    assert set(data) == {"command", "config", "cases", "link", "real"}
    assert len(data["command"]) == 2 and "--early-exit" in data["command"][1]
    assert set(data["config"]["cases"]) == {"steady", "intermittent", "early_exit_late"}
    assert data["config"]["cases"]["steady"]["real"]["balancer"]["every_n_steps"] == 10
    assert {r["case"] for r in data["real"]} == {"steady", "intermittent", "early_exit_late"}
    dynmo = next(r for r in data["real"] if r["case"] == "steady" and r["policy"] == "optimal")
    assert dynmo["over_uniform"] == pytest.approx(1.25) and dynmo["ci95"] == pytest.approx([1.25, 1.25])
    assert dynmo["share_of_ideal"] == pytest.approx(1.25 / dynmo["ideal_ratio"])
