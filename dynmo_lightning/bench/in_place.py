"""Recovery without restart (issue 48, ``strategy.on_peer_lost="recover"``): one process killed in each phase.

Four CPU processes, started as :func:`~dynmo_lightning.launch.start_ranks` starts them (this process hosts the job's
store, as torchrun's agent does), train a GPT as ``P = 2`` stages x ``D = 2`` replicas. At step ``kill_step`` one
process is SIGKILLed (:class:`~dynmo_lightning.bench.kills.KillAt`) in the phase of the row: a step's start, its
forward, backward or optimizer step, a checkpoint's save, a balancer's layer migration, a consolidation. The survivors
abandon the broken world, agree on the loss through the store, and the intact replica goes on in the same processes,
taking over the lost replica's data; nothing is read from disk. A run that loses nothing is the reference: the
losses after the failure must equal its own (the same global batch every step), to ``1e-5`` relative.

Measured from the workers' own step records (global rank 0 of each world): the time from the kill to the first step
completed after it (``mttr_s``), the completed steps whose work was lost (``steps_lost``: 0 when the survivors' first
completed step is the one the kill interrupted, or the next), tokens per second before and after, and the ideal
after (before x the processes that train after / before). ``python -m dynmo_lightning.bench.in_place --out
docs/bench`` adds the rows ``{"tier": "in_place", ...}`` to ``recovery.json`` (the restart tier's rows and figures
stay).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from dynmo_lightning.bench.recovery import FAULTS, STEPS, StepClock, _rate, records

#: The workers' record of every step's loss (global rank 0 of each world).
LOSSES = "losses.jsonl"
#: Phase of every row and the victim's rank: a last stage (its replica's pipeline partner survives alone and leaves)
#: and, for a step's start, rank 0 (the store the survivors meet at is not in any worker).
VICTIMS = {"step": 0, "forward": 3, "backward": 3, "optimizer": 1, "checkpoint": 1, "migration": 3,
           "consolidation": 3, "copies": 3}  # fmt: skip


def phases_of(mode: str) -> list[str]:
    """The phases a job of ``data_parallel=mode`` is killed in: every one; ``"copies"`` only where there are copies."""
    from dynmo_lightning.bench.kills import PHASES

    return [phase for phase in PHASES if phase != "copies" or mode == "fsdp"]


class StepLosses(pl.Callback):
    """Appends ``{"step", "loss"}`` per step (global rank 0 of each world)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        """Record the step's loss (the mean over the job's global batch)."""
        if trainer.global_rank == 0:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": trainer.global_step - 1, "loss": float(out["loss"])}) + "\n")


class ShrinkAt(pl.Callback):
    """Consolidate every replica onto its pipeline rank 0 at the end of step ``step`` (the others are released)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        """Consolidate when due."""
        control = trainer.strategy.pipeline_control
        if trainer.global_step - 1 == self.step and control.pp_size > 1:
            control.shrink([0], [control.n_layers])


def worker(argv: list[str]) -> None:
    """One process of the job: train, and kill or be killed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dynmo_lightning import DynMoBalancer, DynMoStrategy
    from dynmo_lightning.bench.kills import KillAt
    from dynmo_lightning.data import StdlibCharDataModule
    from dynmo_lightning.launch import torchrun_num_nodes
    from dynmo_lightning.models import GPT

    p = argparse.ArgumentParser(prog="in-place recovery worker")
    p.add_argument("--dir", dest="run", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--phase", default="step")
    p.add_argument("--victim", type=int, default=3)
    p.add_argument("--mode", default="ddp")
    p.add_argument("--on-peer-lost", default="recover")
    a = p.parse_args(argv)
    callbacks: list[pl.Callback] = [StepClock(a.run / STEPS), StepLosses(a.run / LOSSES)]
    if a.kill_step >= 0:
        callbacks.append(KillAt(a.victim, a.kill_step, a.phase, record=a.run / FAULTS))
    if a.phase == "migration":
        callbacks.append(DynMoBalancer(method="random", every_n_steps=a.kill_step + 1, warmup_steps=0))
    elif a.phase == "consolidation":
        callbacks.append(ShrinkAt(a.kill_step))
    elif a.phase == "checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=a.run / "checkpoints", save_top_k=-1, every_n_train_steps=10))
    pl.seed_everything(0)
    strategy = DynMoStrategy(n_microbatches=4, data_parallel_size=2, data_parallel=a.mode, heartbeat_timeout=3.0,
                             on_peer_lost=a.on_peer_lost, checkpoint_format="sharded")  # fmt: skip
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))  # torchrun: per node
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=torchrun_num_nodes(), strategy=strategy,
                         max_steps=a.steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=a.phase == "checkpoint",
                         limit_val_batches=0)  # fmt: skip
    model = GPT(n_layer=8, n_embd=64, n_head=4, block_size=32)
    trainer.fit(model, datamodule=StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=400_000))


def run_job(run: Path, args: list[str], timeout: float = 600) -> list[int | None]:
    """Run the four processes of one job (this process hosts its store); their exit codes."""
    from dynmo_lightning.launch import run_ranks

    shutil.rmtree(run, ignore_errors=True)  # records are appended: a run's own only
    run.mkdir(parents=True)
    argv = [sys.executable, "-m", "dynmo_lightning.bench.in_place", "worker", "--dir", str(run), *args]
    return run_ranks(4, argv, log_dir=run, tag="job", timeout=timeout)


def measure(run: Path, reference: Path) -> dict[str, Any]:
    """The recovery's figures from a killed run's records, and whether its losses equal the reference's."""
    steps, (fault,) = [r for r in records(run) if r["event"] == "step"], records(run, FAULTS)
    before = [r for r in steps if r["time"] < fault["time"]]
    after = [r for r in steps if r["time"] >= fault["time"]]
    losses = {r["step"]: r["loss"] for r in records(run, LOSSES)}  # a step's last record: the completed attempt
    expected = {r["step"]: r["loss"] for r in records(reference, LOSSES)}
    worst = max(abs(losses[s] - loss) / abs(loss) for s, loss in expected.items()) if len(losses) == len(
        expected) else float("inf")  # fmt: skip
    ideal = _rate(before) * after[-1]["world"] / before[-1]["world"]
    return {
        "phase": fault["phase"],
        "killed_rank": fault["rank"],
        "killed_at_step": fault["step"],
        # steps completed before the kill minus the step the survivors' first completed step started at
        "steps_lost": before[-1]["step"] - (after[0]["step"] - 1),
        "mttr_s": after[0]["time"] - fault["time"],
        "world_before": before[-1]["world"],
        "world_after": after[-1]["world"],
        "tokens_per_s_before": _rate(before),
        "tokens_per_s_after": _rate(after),
        "ideal_tokens_per_s_after": ideal,
        "after_over_ideal": _rate(after) / ideal,
        "final_step": after[-1]["step"],
        "max_rel_loss_difference": worst,
        "exact": worst <= 1e-5,
    }


def in_place_row(work: Path, phase: str, reference: Path, mode: str = "ddp", kill_step: int = 20) -> dict[str, Any]:
    """One ``tier="in_place"`` row: rank ``VICTIMS[phase]`` killed at ``kill_step`` in ``phase``."""
    run = work / f"in-place-{mode}-{phase}"
    args = ["--mode", mode, "--kill-step", str(kill_step), "--phase", phase, "--victim", str(VICTIMS[phase])]
    codes = run_job(run, args)
    facts = measure(run, reference)
    victim = facts["killed_rank"]
    facts["exact"] = facts["exact"] and all(code == 0 for r, code in enumerate(codes) if r != victim)
    return {"tier": "in_place", "data_parallel": mode, "background_checkpoints": False, **facts, "exit_codes": codes}


def overhead(work: Path, mode: str, repeats: int = 3) -> dict[str, Any]:
    """What being ready to recover costs a job that loses nothing: ``on_peer_lost="recover"`` against ``"stop"``.

    The same uninterrupted job under both, alternating which runs first in each of ``repeats`` pairs; tokens/s after
    5 warm-up steps; the ratio recover / stop per pair (its median headlines: this machine's noise is in the range).
    """
    rates: dict[str, list[float]] = {"stop": [], "recover": []}
    for i in range(repeats):
        for policy in ("stop", "recover") if i % 2 == 0 else ("recover", "stop"):
            run = work / f"cost-{mode}-{policy}-{i}"
            codes = run_job(run, ["--mode", mode, "--on-peer-lost", policy])
            if codes != [0, 0, 0, 0]:
                raise RuntimeError(f"the {policy} run failed: exit codes {codes} (logs in {run})")
            rates[policy].append(_rate([r for r in records(run) if r["event"] == "step"], skip=5))
    ratios = sorted(r / s for r, s in zip(rates["recover"], rates["stop"], strict=True))
    return {"tokens_per_s": rates, "ratios": ratios, "ratio_median": ratios[len(ratios) // 2]}


def overhead_table(result: dict[str, Any]) -> str:
    """The Markdown table of the readiness cost (docs/reliability.md; a test holds the page equal to it)."""
    lines = ["| data parallel | tokens/s, stop | tokens/s, recover | recover / stop (median, range) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for mode, cost in result.get("in_place", {}).get("overhead", {}).items():
        stop, recover = (sorted(cost["tokens_per_s"][p]) for p in ("stop", "recover"))
        lines.append(
            f"| {mode} | {stop[len(stop) // 2]:.0f} | {recover[len(recover) // 2]:.0f} | {cost['ratio_median']:.2f} "
            f"({cost['ratios'][0]:.2f}\u2013{cost['ratios'][-1]:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The in-place tier's rows of ``recovery.json``."""
    return [r for r in result["rows"] if r.get("tier") == "in_place"]


def front_page(result: dict[str, Any]) -> str:
    """The README's sentence on recovery without restart, from ``recovery.json`` (a test holds the README to it)."""
    moved = rows(result)
    mttr = [r["mttr_s"] for r in moved]
    worst = max(r["max_rel_loss_difference"] for r in moved)
    exact = all(r["exact"] for r in moved)
    return (
        "**Recovery without restart** (`on_peer_lost=\"recover\"`, P = 2 x D = 2 ddp and fsdp on 4 CPU processes, "
        "one SIGKILLed in each phase: a step, forward, backward, optimizer step, checkpoint save, migration, "
        "consolidation, fsdp's copies of its shards; "
        "[docs/reliability.md](docs/reliability.md#recovery-without-restart)): the intact replica goes on in the "
        f"same processes, **{min(mttr):.1f}\u2013{max(mttr):.1f} s** from the kill to the next step, "
        f"{max(r['steps_lost'] for r in moved)} steps lost, every loss after it "
        f"{'equal to' if exact else 'NOT equal to'} the job never killed (max rel {worst:.0e})."
    )


def tables(moved: list[dict[str, Any]]) -> str:
    """The Markdown table of docs/reliability.md's in-place section (a test holds the page equal to it)."""
    lines = ["| data parallel | phase killed | rank | time to the next step | steps lost | world | tokens/s before → "
             "after (ideal) | losses vs. never killed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in moved:
        lines.append(
            f"| {r['data_parallel']} | {r['phase']} | {r['killed_rank']} | {r['mttr_s']:.1f} s | {r['steps_lost']} | "
            f"{r['world_before']} → "
            f"{r['world_after']} | {r['tokens_per_s_before']:.0f} → {r['tokens_per_s_after']:.0f} "
            f"({r['ideal_tokens_per_s_after']:.0f}) | {r['max_rel_loss_difference']:.1e} "
            f"{'(exact)' if r['exact'] else '(NOT exact)'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """``python -m dynmo_lightning.bench.in_place --out docs/bench``: the in-place rows, added to recovery.json.

    ``--modes``: the data-parallel modes measured (their rows replace the file's rows of the same modes).
    ``--overhead N``: instead, what being ready costs a job that loses nothing (:func:`overhead`, ``N`` pairs).
    """
    p = argparse.ArgumentParser(prog="python -m dynmo_lightning.bench.in_place")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--work", type=Path, default=Path("bench/in_place"))
    p.add_argument("--modes", nargs="*", default=["ddp", "fsdp"])
    p.add_argument("--overhead", type=int, default=0)
    a = p.parse_args(argv)
    path = a.out / "recovery.json"
    result = json.loads(path.read_text()) if path.exists() else {"rows": []}
    command = "python -m dynmo_lightning.bench.in_place " + " ".join(argv if argv is not None else sys.argv[1:])
    before = result.get("in_place", {})
    if a.overhead:
        costs = {mode: overhead(a.work, mode, a.overhead) for mode in a.modes}
        overheads = {**before.get("overhead", {}), **costs}
        result["in_place"] = {**before, "overhead": overheads, "overhead_command": command}
        print(overhead_table(result))
    else:
        result["rows"], result["in_place"] = _measure_rows(a.work, a.modes, result["rows"], before, command)
        print(tables(rows(result)))
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def _measure_rows(
    work: Path, modes: list[str], old: list[dict[str, Any]], before: dict[str, Any], command: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The file's rows with every phase of ``modes`` measured anew, and the in-place record naming the commands."""
    measured = []
    for mode in modes:
        reference = work / f"uninterrupted-{mode}"
        codes = run_job(reference, ["--mode", mode])
        if codes != [0, 0, 0, 0]:
            raise RuntimeError(f"the uninterrupted reference run failed: exit codes {codes} (logs in {reference})")
        measured += [in_place_row(work, phase, reference, mode) for phase in phases_of(mode)]
    kept = [r for r in old if r.get("tier") != "in_place" or r.get("data_parallel") not in modes]
    # the command of rows kept (an older file names one for ddp's)
    commands = before.get("commands") or ({"ddp": before["command"]} if "command" in before else {})
    record = {
        **{k: v for k, v in before.items() if k != "command"},
        "commands": {**commands, **dict.fromkeys(modes, command)},
        "setup": "4 CPU processes (one machine, the job's store in the launching process), GPT 8 blocks width 64, "
        "batch 8 x 32 tokens per replica, 4 micro-batches, 1F1B, AdamW, P = 2 stages x D = 2 replicas "
        "(data_parallel of the row), heartbeat_timeout 3 s; one process SIGKILLed at step 20 of 40; the reference "
        "is the same job never killed",
    }
    return kept + measured, record


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        main()
