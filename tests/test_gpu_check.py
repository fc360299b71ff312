"""The prepared GPU check runs end to end on CPU (the same code path it takes on a GPU) where Hydra is not installed,
as on the GPU machine; its per-dynamic path runs twice in one process; a synchronisation's site names our line;
after a section raises on a GPU, every later one runs in a process of its own; a section that cannot run is null,
not ok; its two parts (one call each on a device lent for minutes) split the sections between them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dynmo_lightning.callbacks import HostSyncCounter
from dynmo_lightning.launch import FIT_ENV, clean_env
from dynmo_lightning.protocol import read_once

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "gpu_check.py"

#: A ``sitecustomize`` that makes hydra and omegaconf look not installed: no import, no spec, no metadata (Lightning
#: asks all three before it uses them).
HIDE_HYDRA = """
import importlib.abc, importlib.metadata, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("hydra", "omegaconf"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
_from_name = importlib.metadata.Distribution.from_name.__func__

def _hidden(cls, name):
    if name.lower().replace("_", "-") in ("hydra-core", "omegaconf"):
        raise importlib.metadata.PackageNotFoundError(name)
    return _from_name(cls, name)

importlib.metadata.Distribution.from_name = classmethod(_hidden)
"""


#: Whether hydra imports, omegaconf has a spec, hydra-core has metadata (each must be gone).
PROBE = """
import importlib.metadata as m, importlib.util as u

def gone(ask):
    try:
        ask()
    except (ImportError, m.PackageNotFoundError):
        return True
    return False

print(gone(lambda: __import__("hydra")), gone(lambda: u.find_spec("omegaconf")), gone(lambda: m.version("hydra-core")))
"""


def _without_hydra(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "no_hydra"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_HYDRA)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_on_cpu_without_hydra(tmp_path):
    env = _without_hydra(tmp_path)
    hidden = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert hidden.stdout.split() == ["True"] * 3, hidden.stdout + hidden.stderr
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--steps", "4", "--dynamics", "none,early_exit",
           "--pipeline", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(out.read_text())
    s = summary["sections"]
    assert summary["ok"] and summary["device"] == "cpu" and "dynamics.early_exit" in s and not summary["pending"]
    # compiled layers compile for minutes on CPU: not run, null, not counted
    assert summary["skipped_sections"] == ["compile", "compile_fsdp"] and s["compile"]["ok"] is None
    assert summary["ran"] == len(s) - 2 and all(s[name]["ok"] for name in s if name not in ("compile", "compile_fsdp"))
    assert s["refuses_16_mixed"]["refused"] and "bf16-mixed" in s["refuses_16_mixed"]["message"]
    assert s["device_vs_cpu"]["max_rel_diff"] == 0.0  # CPU against CPU: the same numbers
    assert s["device_vs_cpu"]["clipping_changed_losses"]  # gradient_clip_val set: the one-collective clipping ran
    ac = s["activation_checkpointing"]
    assert ac["ok"] and ac["max_rel_diff_vs_without"] == 0.0 and len(ac["losses"]) == 4  # recomputed, same math
    assert not any(entry.get("isolated") for entry in s.values())  # nothing failed: all in this process
    assert 0 < s["bf16_vs_fp32"]["max_rel_diff"] <= s["bf16_vs_fp32"]["tolerance"]  # bf16 did run
    for name in ("dynamics.none", "dynamics.early_exit"):
        entry = s[name]
        assert all(
            0 < o <= n for o, n in zip(entry["of_which_optimizer_step"], entry["host_syncs_per_step"], strict=True)
        )
        assert len(entry["host_syncs_per_step"]) == 3 and entry["cuda_syncs_per_step"] == [0, 0, 0]
    assert s["profile"]["layers"] == 6 and s["profile"]["layers_s"] > 0  # embedding, 4 blocks, head
    assert s["migration"]["fused"]["identical"] and s["migration"]["foreach"]["state_arrived"]
    for kind in ("foreach", "fused"):  # an FSDP2 unit packed, adopted on a one-process gloo mesh, stepped again
        adopted = s["fsdp_migration"][kind]
        assert adopted["identical"] and adopted["unit"] and adopted["sharded_gradients"]
        assert adopted["same_forward"] and adopted["max_abs_diff"] == 0
    resumed = s["checkpoint_fsdp"]  # DCP of DTensors
    assert resumed["sharded"] and resumed["resumed_parameters"]["dtensor_parameters"] and resumed["max_rel_diff"] == 0
    for run in ("ddp.fp32", "ddp.bf16", "fsdp.fp32", "fsdp.bf16"):  # predicted from the run's own profile
        (stage,) = s["memory"][run]["stages"]
        assert stage["predicted_peak_bytes"] > 0 and stage["max_memory_allocated"] is None  # no allocator stats on CPU
    assert s["hf_pruning"]["pruned"] and s["checkpoint"]["sharded"] and s["checkpoint"]["max_rel_diff"] == 0.0
    assert s["layer_costs"]["table"]["block"]["trainable"]["fwd"] > 0
    assert s["fsdp"]["dtensor_parameters"] and s["fsdp"]["fp32_shards"]  # FSDP2's bf16 mixed precision, a mesh of one
    assert s["fsdp_two_gpus"]["replicas"] == 2 and s["fsdp_two_gpus"]["max_rel_loss_diff_vs_one_device"] <= 1e-5
    tp = s["tensor_parallel_two_gpus"]  # every layer's heads and MLP split over two processes: the same math
    assert tp["tensor_parallel_size"] == 2 and tp["max_rel_loss_diff_vs_one_device"] <= 1e-5
    p2 = s["pipeline_p2"]
    assert [len(p["layers_per_stage"]) for p in p2["partitions"]] == [2, 2, 1] and p2["world_size_end"] == 1
    assert p2["max_rel_loss_diff_vs_p1"] <= 1e-6


def _gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_a_dynamic_runs_twice_in_one_process_each_time_in_a_world_of_its_own(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    inits: list[str] = []
    init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: (inits.append(backend), init(backend, **kw)))
    before = {k: os.environ.get(k) for k in FIT_ENV}
    results = []
    for _ in range(2):
        check = gpu_check.Check(gpu_check.Device("cpu"), steps=3, quick=True)
        results.append(gpu_check.dynamic_syncs(check, "early_exit"))
        assert not dist.is_initialized() and {k: os.environ.get(k) for k in FIT_ENV} == before
    assert inits == ["gloo", "gloo"]  # the second run started its own world, not the first one's
    assert results[0] == results[1] and results[0]["ok"]


def test_a_synchronisation_is_reported_at_the_line_that_led_to_it(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    tolist = torch.Tensor.tolist

    def synchronising(t: torch.Tensor) -> list:
        # What CUDA's sync debug mode does: a warning from the op, attributed to the Python line that called it.
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=2)
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", synchronising)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)  # a CPU build has no debug mode
    shown = warnings._showwarnmsg
    counter, sites = HostSyncCounter(cuda=True), gpu_check.SyncSites()
    with counter.patched():  # its wrapper of Tensor.tolist sits between our line and the op
        sites.on_train_start(None, None)
        counter.on_train_batch_start(None, None, None, 0)  # the counter opens the step's window first
        sites.on_train_batch_start(None, None, None, 0)
        read_once([torch.tensor(1.0), torch.tensor(2.0)])
        counter.on_train_end(None, None)
        sites.on_train_end(None, None)
    assert counter.counts == [1]  # one host read: the synchronisation CUDA reports for it is that read
    ((site, n),) = sites.steps[0].items()
    # issued at read_once's line (the counter's wrapper skipped), which is also our innermost frame
    assert n == 1 and re.fullmatch(
        r"dynmo_lightning/core/host_values.py:(\d+) <- dynmo_lightning/core/host_values.py:\1 \(read_once\)", site
    )
    assert warnings._showwarnmsg is shown  # unwrapped after the fit


def test_on_a_gpu_the_profilers_device_time_is_its_kernels_time(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    class Event:
        def __init__(self, device_type, device_us, cpu_us):
            self.device_type, self.self_device_time_total, self.self_cpu_time_total = device_type, device_us, cpu_us

    class Profile:  # an op (whose self device time is its kernels') and its two kernels
        def key_averages(self):
            return [Event(cpu, 300.0, 50.0), Event(cuda, 100.0, 0.0), Event(cuda, 200.0, 0.0)]

    gpu, host = gpu_check.Device("cuda"), gpu_check.Device("cpu")
    assert gpu.profiled_seconds(Profile()) == pytest.approx(300e-6)  # each kernel once, not again through its op
    assert host.profiled_seconds(Profile()) == pytest.approx(50e-6)
    assert (gpu.accelerator, host.accelerator) == ("gpu", "cpu")
    assert torch.profiler.ProfilerActivity.CUDA in gpu.profiler_activities()
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 allowed: wider tolerances
    assert (gpu.matmul_precision(), host.matmul_precision()) == ("tf32", "highest")


def test_after_a_gpu_section_raises_every_later_section_runs_in_a_process_of_its_own(monkeypatch, tmp_path):
    gpu_check = _gpu_check(monkeypatch)
    monkeypatch.setattr(gpu_check.Device, "cuda", property(lambda self: True))  # no GPU here: the device says so
    monkeypatch.setattr(gpu_check.Device, "describe", lambda self: {"device": "cuda"})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    isolated: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(
        gpu_check,
        "run_isolated",
        lambda name, options: (isolated.append((name, options)), {"ok": True, "isolated": True})[1],
    )

    def device_side_assert(check):
        raise RuntimeError("CUDA error: device-side assert triggered")

    ran = []
    chosen = {
        "first": lambda check: (ran.append("first"), {"ok": True})[1],
        "moe": device_side_assert,
        "later": lambda check: (ran.append("later"), {"ok": True})[1],
        "last": lambda check: {"ok": True},
    }
    check = gpu_check.Check(gpu_check.Device("cuda"), steps=3, quick=True)
    summary = gpu_check.check_all(check, chosen, tmp_path / "out.json", ["--device", "cuda"])
    s = summary["sections"]
    assert ran == ["first"] and s["moe"]["error"]["type"] == "RuntimeError" and not summary["ok"]
    assert isolated == [("later", ["--device", "cuda"]), ("last", ["--device", "cuda"])]
    assert s["later"]["isolated"] and s["last"]["ok"] and json.loads((tmp_path / "out.json").read_text()) == summary


@pytest.mark.timeout(180)
def test_an_isolated_section_runs_in_a_fresh_process_and_reports_as_in_this_one(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    entry = gpu_check.run_isolated("migration", ["--device", "cpu", "--quick", "--steps", "3"])
    assert entry["isolated"] and entry["ok"] and entry["fused"]["identical"], entry
    failed = gpu_check.run_isolated("migration", ["--device", "cpu", "--no-such-option"])
    assert not failed["ok"] and failed["error"]["type"] == "ChildProcessError" and "--no-such-option" in str(failed)


def test_a_section_that_cannot_run_is_null_and_does_not_count_as_ok(monkeypatch, tmp_path):
    gpu_check = _gpu_check(monkeypatch)
    monkeypatch.setattr(gpu_check.Device, "cuda", property(lambda self: True))  # one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check.Device, "describe", lambda self: {"device": "cuda"})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    check = gpu_check.Check(gpu_check.Device("cuda"), steps=3, quick=True)
    two_gpus = ("fsdp_two_gpus", "tensor_parallel_two_gpus", "pipeline_p2")
    chosen = {"passes": lambda check: {"ok": True}, **{name: gpu_check.SECTIONS[name] for name in two_gpus}}
    summary = gpu_check.check_all(check, chosen, tmp_path / "out.json", [])
    s = summary["sections"]
    assert all(s[name]["ok"] is None and "two GPUs" in s[name]["skipped"] for name in two_gpus)
    assert summary["ok"] is True and (summary["ran"], summary["skipped"]) == (1, 3)
    assert summary["skipped_sections"] == list(two_gpus) and summary["pending"] == []
    # a skipped section does not make a failure pass, and a check where nothing ran has no verdict
    chosen = {"fails": lambda check: {"ok": False}, "fsdp_two_gpus": gpu_check.SECTIONS["fsdp_two_gpus"]}
    assert gpu_check.check_all(check, chosen, tmp_path / "out.json", [])["ok"] is False
    nothing = gpu_check.check_all(check, {"fsdp_two_gpus": gpu_check.fsdp_two_gpus}, tmp_path / "out.json", [])
    assert nothing["ok"] is None and nothing["ran"] == 0
    # on CPU the compiled sections run only when asked (they compile for minutes)
    cpu = gpu_check.Check(gpu_check.Device("cpu"), steps=3, quick=True)
    assert gpu_check.compiled(cpu)["ok"] is None and gpu_check.compiled_fsdp(cpu)["ok"] is None


def test_the_two_parts_split_the_sections_and_each_fits_a_five_minute_call(monkeypatch):
    gpu_check = _gpu_check(monkeypatch)
    dynamics = ["none", *gpu_check.PRESETS]
    everything = gpu_check.sections(dynamics)
    parts = {n: gpu_check.sections(dynamics, n) for n in gpu_check.PARTS}
    assert sorted(parts) == [1, 2]
    for name in everything:  # every section in exactly one part
        assert [n for n, part in parts.items() if name in part] in ([1], [2]), name
    assert list(everything) == [*parts[1], *parts[2]]  # without --part: both, in their order
    assert set(gpu_check.SECTIONS) | {"dynamics"} == {n for names in gpu_check.PARTS.values() for n in names}
    assert set(gpu_check.ESTIMATED_SECONDS) == set(gpu_check.SECTIONS) | {"dynamics"}
    for part in parts.values():  # estimated on one H100/H200, and with two GPUs (its two-process sections run)
        assert gpu_check.estimated_seconds(list(part)) <= 240
        assert gpu_check.estimated_seconds(list(part), gpus=2) <= 270
