"""``dynmo-bench``: every dynamic technique under every balancing policy, measured side by side and simulated at scale.

Three parts, all driven by ``conf/bench.yaml`` (Hydra; e.g. ``dynmo-bench dynamics=[freezing,pruning]
policies=[uniform,optimal] real.repeats=1``):

1. **Real runs** on CPU ranks (gloo; ``real.accelerator=gpu`` for NCCL): for each dynamic, every policy trains the same
   model from the same seed, alternating policies (A B A B ...) within one set of processes so that machine drift
   cancels. Reported: tokens/s after ``real.measure_from`` steps, the ratio to ``uniform``, and the ideal ratio the
   1F1B cost model predicts from the per-layer costs the balancer measured (uniform split vs optimal split).
2. **Cost traces** of a deep model (``trace.layers`` >= 48 blocks) trained with each dynamic active, profiled every
   step on one process (``costs.jsonl`` per dynamic).
3. **Simulated runs** at ``sim.stages`` (8..64) replaying those traces through the discrete-event simulator with each
   policy (the same planners as the runtime): speed-up over ``uniform`` and ``params``, rank-seconds saved by
   repacking, imbalance over time.

Writes ``results.json``, ``benchmarks.md`` (tables) and PNG plots into the run directory, with progress (which case,
how far, time left) on stdout. ``python -m dynmo_lightning.bench worker SPEC`` is the per-rank entry of part 1 and 2.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as L
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.balance import partition, stage_times, step_time
from dynmo_lightning.callbacks import (
    CostTrace,
    DynamicSparseAttention,
    GradualPruning,
    LayerFreezing,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import run_ranks
from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.groups import open_store

#: The benchmark's Hydra config directory (``conf/bench``, shipped inside the package).
_CONF = Path(__file__).resolve().parent / "conf" / "bench"

#: End-to-end speed-ups the DynMo paper reports over static Megatron-LM / DeepSpeed splits.
SEED = {"moe": 1.23, "pruning": 3.18, "freezing": 2.23, "sparse_attention": 4.02, "early_exit": 4.52, "mod": 1.17}
DYNAMICS = ("none", "freezing", "pruning", "early_exit", "mod", "moe", "sparse_attention")
POLICIES = ("uniform", "params", "static_time", "optimal", "diffusion", "optimal+repack")


def dynamic_callback(name: str, n_layers: int, steps: int) -> L.Callback | None:
    """The dynamic technique, scheduled to act over the first part of a ``steps``-long run."""
    early = max(2, steps // 8)
    if name == "none":
        return None
    if name == "freezing":  # AutoFreeze decides the same way with real signals; a schedule keeps runs comparable
        return LayerFreezing(mode="schedule", schedule={i: early + i for i in range(n_layers // 2)}, start_step=0)
    if name == "pruning":
        return GradualPruning(final_sparsity=0.75, start_step=1, end_step=2 * early, every_n_steps=max(1, early // 4))
    if name == "early_exit":
        return TokenEarlyExit(threshold=0.8, warmup_steps=early, ramp_steps=early)
    if name == "mod":
        return MixtureOfDepths(capacity=0.125, start_step=1, anneal_steps=2 * early)
    if name == "moe":
        return MixtureOfExperts(n_experts=4, capacity_factor=1.0)
    if name == "sparse_attention":
        return DynamicSparseAttention(attn_block=16, target_coverage=0.8)
    raise ValueError(f"unknown dynamic {name!r}; valid: {list(DYNAMICS)}")


def policy_parts(policy: str, every_n_steps: int) -> tuple[str, DynMoBalancer | None]:
    """The strategy's initial partition and the balancer that implement ``policy``."""
    if policy == "uniform":
        return "uniform", None
    if policy == "params":
        return "params", None
    if policy == "optimal+repack":
        # Released processes wait for the end of the run, then join the next case of the benchmark.
        return "uniform", DynMoBalancer(
            every_n_steps=every_n_steps,
            warmup_steps=2,
            min_gain=0.02,
            repack=True,
            repack_tolerance=0.05,
            on_release="wait",
        )
    if policy in ("static_time", "optimal", "diffusion"):
        return "uniform", DynMoBalancer(method=policy, every_n_steps=every_n_steps, warmup_steps=2, min_gain=0.02)
    raise ValueError(f"unknown policy {policy!r}; valid: {list(POLICIES)}")


class StepTimer(L.Callback):
    """Wall time of the training steps from ``start_step`` on (rank 0's clock; the pipeline advances in lockstep)."""

    def __init__(self, start_step: int) -> None:
        self.start_step, self.t0, self.steps, self.seconds = start_step, 0.0, 0, 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Start the clock at ``start_step``."""
        if trainer.global_step == self.start_step:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, b: Any, i: int) -> None:
        """Time and steps so far (the last step's values stand)."""
        self.seconds = time.perf_counter() - self.t0
        self.steps = trainer.global_step - self.start_step


def ideal_ratio(values: dict[str, list[float]], n_stages: int, n_microbatches: int) -> float:
    """Step time of the uniform split over the optimal split's, by the 1F1B cost model, from measured costs."""
    costs = [f + b for f, b in zip(values["fwd"], values["bwd"], strict=True)]

    def predicted(split: list[int]) -> float:
        return step_time(*stage_times(values["fwd"], values["bwd"], split), n_microbatches, "1f1b")

    uniform = partition(costs, n_stages, method="uniform")
    return predicted(uniform) / predicted(partition(costs, n_stages, method="optimal"))


# ---------------------------------------------------------------------------------------------------------------------
# Worker side: one rank of a launch, running cases back to back
# ---------------------------------------------------------------------------------------------------------------------
def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Train one case (real run or trace recording) in this process; returns what rank 0 measured."""
    L.seed_everything(0)
    model_kw, data_kw, steps = case["model"], case["data"], case["steps"]
    callback = dynamic_callback(case["dynamic"], model_kw["n_layer"] + 2, steps)
    initial, balancer = policy_parts(case["policy"], case["every_n_steps"])
    timer = StepTimer(case["measure_from"])
    callbacks: list[L.Callback] = [timer, *(c for c in (callback, balancer) if c is not None)]
    if case.get("trace"):
        callbacks.append(CostTrace(case["trace"], every_n_steps=1))
    trainer = L.Trainer(
        accelerator=case["accelerator"],
        devices=case["world_size"],
        max_steps=steps,
        strategy=DynMoStrategy(n_microbatches=case["microbatches"], partition=initial),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = StdlibCharDataModule(max_bytes=2_000_000, **data_kw)
    trainer.fit(GPT(**model_kw), datamodule=data)
    tokens = data.tokens_per_batch
    result = {
        "tokens_per_s": timer.steps * tokens / timer.seconds if timer.seconds else None,
        "partitions": trainer.strategy.partitions,
        "world_size_end": trainer.world_size,
    }
    if balancer is not None and balancer.tracker is not None and balancer.tracker.samples:
        result["ideal_ratio"] = ideal_ratio(balancer.tracker.values, case["world_size"], case["microbatches"])
    return result


def worker(spec_path: str) -> None:
    """Run the cases of ``spec_path`` in this rank; rank 0 writes each case's result file."""
    spec = json.loads(Path(spec_path).read_text())
    for case, port in zip(spec["cases"], spec["ports"], strict=True):
        # Every case starts a fresh world (a consolidating case releases ranks and shrinks its own).
        os.environ["MASTER_PORT"] = str(port)
        try:
            result = _run_case(case)
            if dist.is_initialized() and dist.get_rank() == 0:
                Path(case["result"]).write_text(json.dumps(result))
        except SystemExit as released:  # consolidation released this process: it simply joins the next case
            if released.code not in (0, None):
                raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------------------------------
class Progress:
    """Which case, how far, and the time left (linear extrapolation)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        """Report one finished case."""
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        print(f"[dynmo-bench] {self.done}/{self.total} {what}  elapsed {elapsed:.0f}s, ~{left:.0f}s left", flush=True)


def _launch(
    world_size: int, cases: list[dict[str, Any]], out: Path, tag: str, timeout: float, resume: bool = False
) -> None:
    """Run ``cases`` back to back in one set of ``world_size`` processes, reporting progress as results appear.

    With ``resume``, cases whose result file exists (from an earlier, interrupted or finished run into the same
    directory) are kept and not run again.
    """
    if resume:
        cases = [case for case in cases if not Path(case["result"]).exists()]
        if not cases:
            return
    spec = out / f"{tag}.json"
    # Every case starts a fresh world; the stores its ranks meet at are hosted here, open (and so reserved) until
    # the launch ends.
    stores = [open_store("127.0.0.1", timedelta(minutes=10)) for _ in cases]
    spec.write_text(json.dumps({"cases": cases, "ports": [store.port for store in stores]}))
    progress = Progress(len(cases))

    def poll() -> None:
        for case in cases[progress.done :]:
            if not Path(case["result"]).exists():
                break
            progress.step(case["name"])

    codes = run_ranks(
        world_size,
        [sys.executable, "-m", "dynmo_lightning.bench", "worker", str(spec)],
        log_dir=out / "logs",
        tag=tag,
        timeout=timeout * len(cases),
        poll=poll,
    )
    if any(c != 0 for c in codes):
        raise RuntimeError(f"benchmark processes failed (exit codes {codes}); see {out / 'logs'}/{tag}.rank*.log")


def real_runs(cfg: DictConfig, out: Path) -> list[dict[str, Any]]:
    """Part 1: every dynamic x policy on ``real.world_size`` ranks, alternating policies, repeated."""
    real = cfg.real
    cases = []
    for rep in range(real.repeats):
        for dynamic in cfg.dynamics:
            for policy in cfg.policies:
                name = f"{dynamic}-{policy}-{rep}"
                cases.append(
                    {
                        "name": name,
                        "dynamic": dynamic,
                        "policy": policy,
                        "steps": real.steps,
                        "measure_from": real.measure_from,
                        "every_n_steps": real.every_n_steps,
                        "microbatches": real.microbatches,
                        "world_size": real.world_size,
                        "accelerator": real.accelerator,
                        "model": OmegaConf.to_container(real.model),
                        "data": OmegaConf.to_container(real.data),
                        "result": str(out / "real" / f"{name}.json"),
                    }
                )
    (out / "real").mkdir(parents=True, exist_ok=True)
    _launch(real.world_size, cases, out, "real", real.timeout, cfg.resume)
    rows = []
    for dynamic in cfg.dynamics:
        runs = {
            p: [json.loads((out / "real" / f"{dynamic}-{p}-{r}.json").read_text()) for r in range(real.repeats)]
            for p in cfg.policies
        }
        speed = {p: [r["tokens_per_s"] for r in rs] for p, rs in runs.items()}
        mean = {p: sum(v) / len(v) for p, v in speed.items()}
        ideal = next((r["ideal_ratio"] for rs in runs.values() for r in rs if "ideal_ratio" in r), None)
        for p in cfg.policies:
            rows.append(
                {
                    "dynamic": dynamic,
                    "policy": p,
                    "tokens_per_s": speed[p],
                    "mean_tokens_per_s": mean[p],
                    "ratio_to_uniform": mean[p] / mean["uniform"] if "uniform" in mean else None,
                    "ideal_ratio": ideal,
                    "partitions": runs[p][-1]["partitions"],
                    "world_size_end": runs[p][-1]["world_size_end"],
                }
            )
    return rows


def record_traces(cfg: DictConfig, out: Path) -> dict[str, Path]:
    """Part 2: a cost trace of the deep model for every dynamic (one process, profiled every step)."""
    trace = cfg.trace
    (out / "traces").mkdir(parents=True, exist_ok=True)
    cases = []
    for dynamic in cfg.dynamics:
        path = out / "traces" / f"{dynamic}.jsonl"
        cases.append(
            {
                "name": f"trace-{dynamic}",
                "dynamic": dynamic,
                "policy": "uniform",
                "steps": trace.steps,
                "measure_from": 1,
                "every_n_steps": trace.steps,
                "microbatches": trace.microbatches,
                "world_size": 1,
                "accelerator": trace.accelerator,
                "model": OmegaConf.to_container(trace.model),
                "data": OmegaConf.to_container(trace.data),
                "trace": str(path),
                "result": str(out / "traces" / f"{dynamic}.json"),
            }
        )
    _launch(1, cases, out, "traces", trace.timeout, cfg.resume)
    return {dynamic: out / "traces" / f"{dynamic}.jsonl" for dynamic in cfg.dynamics}


def simulated_runs(cfg: DictConfig, traces: dict[str, Path]) -> list[dict[str, Any]]:
    """Part 3: replay every trace at every stage count with every policy."""
    from dynmo_lightning.balance import stage_loads
    from dynmo_lightning.sim import load_trace, simulate_run

    rows = []
    progress = Progress(len(traces) * len(cfg.sim.stages))
    for dynamic, path in traces.items():
        trace = load_trace(path)
        for n_stages in cfg.sim.stages:
            results = {
                policy: simulate_run(
                    trace,
                    policy,
                    n_stages,
                    n_microbatches=cfg.sim.microbatches_per_stage * n_stages,
                    every_n_steps=cfg.sim.every_n_steps,
                    bandwidth=cfg.sim.bandwidth,
                )
                for policy in cfg.policies
            }
            for policy, run in results.items():
                loads = []
                for record, (_, split) in zip(trace, _split_per_step(run), strict=False):
                    costs = [f + b for f, b in zip(record["fwd"], record["bwd"], strict=True)]
                    loads.append(stage_loads(costs, split))
                rows.append(
                    {
                        "dynamic": dynamic,
                        "n_stages": n_stages,
                        "policy": policy,
                        "total_time": run.total_time,
                        "speedup_over_uniform": results["uniform"].total_time / run.total_time
                        if "uniform" in results
                        else None,
                        "speedup_over_params": results["params"].total_time / run.total_time
                        if "params" in results
                        else None,
                        "rank_seconds": run.rank_seconds,
                        "rank_seconds_saved": 1 - run.rank_seconds / results["optimal"].rank_seconds
                        if "optimal" in results and policy == "optimal+repack"
                        else None,
                        "imbalance": list(run.imbalance),
                        "steps": list(run.steps),
                        "stage_loads": loads,
                        "partitions": [{"step": st, "layers_per_stage": lps} for st, lps in run.partitions],
                        "world_sizes": [{"step": st, "world_size": w} for st, w in run.world_sizes],
                    }
                )
            progress.step(f"simulate {dynamic} P={n_stages}")
    return rows


def _split_per_step(run: Any) -> list[tuple[int, list[int]]]:
    """The partition in force at each simulated step."""
    changes = sorted(run.partitions)
    out, current = [], changes[0][1]
    for step in run.steps:
        for s, split in changes:
            if s <= step:
                current = split
        out.append((step, current))
    return out


def machine() -> dict[str, str]:
    """Where the numbers come from."""
    import lightning

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


@hydra.main(
    version_base="1.3", config_path=str(_CONF), config_name="config"
)
def _bench_main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    unknown = (set(cfg.dynamics) - set(DYNAMICS)) | (set(cfg.policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown dynamics/policies {sorted(unknown)}; valid: {list(DYNAMICS)} / {list(POLICIES)}")
    results: dict[str, Any] = {"config": OmegaConf.to_container(cfg, resolve=True), "machine": machine(), "seed": SEED}
    results["real"] = real_runs(cfg, out) if cfg.real.enabled else []
    results["simulated"] = simulated_runs(cfg, record_traces(cfg, out)) if cfg.sim.enabled else []
    (out / "results.json").write_text(json.dumps(results, indent=2))
    from dynmo_lightning.report import markdown_table, plot_bench

    plots = plot_bench(results, out / "plots")
    (out / "benchmarks.md").write_text(markdown_table(results))
    print(f"[dynmo-bench] wrote {out / 'results.json'}, {out / 'benchmarks.md'} and {len(plots)} plots", flush=True)


def main() -> None:
    """Console script ``dynmo-bench`` (and ``python -m dynmo_lightning.bench worker SPEC`` for the ranks)."""
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        _bench_main()


if __name__ == "__main__":
    main()
