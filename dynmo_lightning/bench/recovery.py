"""Recovery from a lost node by restart: torchrun's elastic agent, in-job checkpoints, automatic resume (issue 48).

Two loopback "nodes" (two torchrun agents of ``nproc`` workers each, meeting at a rendezvous store this process
hosts, as a job's rendezvous host outlives its nodes) train a GPT with ``DynMoStrategy``, a checkpoint every
``every`` steps. At step ``kill_step`` the first worker of node B kills its node (:class:`~dynmo_lightning.bench.
kills.KillAt`, ``scope="node"``: the agent and all its workers, SIGKILL). The survivors' workers stop (the peer is
lost), their agent restarts them (``--max-restarts``), the rendezvous closes with one node after its last call, and
the restarted workers resume from the run's newest complete checkpoint themselves (``auto_resume``) on the smaller
world, the pipeline re-planned for it. Then a reference run is resumed by hand from the same checkpoint on the same
smaller world; the two runs' final parameters are compared.

Measured from the workers' own step records (``steps.jsonl``, global rank 0 of each world): the time from the kill
to the first step completed after it (``mttr_s``), the steps lost (the kill's step minus the step resumed from) and
tokens per second before and after. ``python -m dynmo_lightning.bench.recovery --out docs/bench`` writes
``recovery.json``; the worker entry (``... worker --dir DIR ...``) is what torchrun starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

#: The workers' record of every step (global rank 0 of each world writes it).
STEPS = "steps.jsonl"
#: The fault's record (:class:`~dynmo_lightning.bench.kills.KillAt`).
FAULTS = "faults.jsonl"


class StepClock(pl.Callback):
    """Appends ``{"restart", "world", "step", "time", "tokens"}`` per step, and a ``"start"`` record per fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    def _write(self, trainer: pl.Trainer, **fact: Any) -> None:
        if trainer.global_rank == 0:
            fact = {"restart": self.restart, "world": trainer.world_size, "step": trainer.global_step, **fact}
            with self.path.open("a") as f:
                f.write(json.dumps({**fact, "time": time.time()}) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the fit's start: its world, the step it resumed at and from which checkpoint."""
        self._write(trainer, event="start", ckpt=None if trainer.ckpt_path is None else os.fspath(trainer.ckpt_path))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, out: Any, batch: Any, i: int) -> None:
        """Record the step's end and the tokens it trained on (all replicas)."""
        replicas = trainer.strategy.pipeline_control.dp_size
        self._write(trainer, event="step", tokens=int(batch[0].numel()) * replicas)


def worker(argv: list[str]) -> None:
    """One worker of the job (started by torchrun): train, checkpoint, maybe kill its node."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dynmo_lightning import DynMoStrategy
    from dynmo_lightning.bench.kills import KillAt
    from dynmo_lightning.data import StdlibCharDataModule
    from dynmo_lightning.models import GPT

    p = argparse.ArgumentParser(prog="recovery worker")
    p.add_argument("--dir", dest="run", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--phase", default="step")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--background", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heartbeat", type=float, default=5.0)
    a = p.parse_args(argv)
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=a.run / "checkpoints", save_last=True, save_top_k=-1, every_n_train_steps=a.every),
        StepClock(a.run / STEPS),
    ]
    if a.kill_step and os.environ.get("DYNMO_NODE") == "B" and os.environ["LOCAL_RANK"] == "0":
        rank = int(os.environ["RANK"])
        callbacks.append(KillAt(rank, a.kill_step, a.phase, scope="node", record=a.run / FAULTS))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // devices,  # an elastic job's nodes: what the rendezvous gave
        strategy=DynMoStrategy(n_microbatches=4, heartbeat_timeout=a.heartbeat, async_checkpoint=bool(a.background)),
        max_steps=a.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    model = GPT(n_layer=a.layers, n_embd=a.width, n_head=4, block_size=32)
    data = StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=400_000)
    trainer.fit(model, datamodule=data, ckpt_path=a.ckpt)


def torchrun(
    run: Path, node: str, nnodes: str, nproc: int, port: int, args: list[str], max_restarts: int
) -> subprocess.Popen:
    """Start one "node": a torchrun elastic agent of ``nproc`` workers (log: ``run/node<node>.log``)."""
    from dynmo_lightning.launch import clean_env

    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=recovery-{run.name}",
        "--rdzv-conf=is_host=false,last_call_timeout=5", f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
        "-m", "dynmo_lightning.bench.recovery", "worker", "--dir", str(run), *args,
    ]  # fmt: skip
    log = (run / f"node{node}.log").open("ab")
    env = {**clean_env(), "DYNMO_NODE": node}
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_job(run: Path, nodes: int, nproc: int, args: list[str], *, timeout: float = 900) -> list[int]:
    """Run one job of ``nodes`` loopback nodes (``--nnodes=1:nodes``) to its end; their agents' exit statuses."""
    from dynmo_lightning.pipeline.elastic.survivors import open_store

    run.mkdir(parents=True, exist_ok=True)
    store = open_store("127.0.0.1", timedelta(minutes=30))  # the rendezvous host: outlives the nodes
    agents = [torchrun(run, "AB"[n], f"1:{nodes}", nproc, store.port, args, max_restarts=3) for n in range(nodes)]
    deadline = time.monotonic() + timeout
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    return [agent.returncode for agent in agents]


def records(run: Path, name: str = STEPS) -> list[dict[str, Any]]:
    """The JSON-lines records of ``run``."""
    path = run / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def measure(run: Path) -> dict[str, Any]:
    """The recovery's figures from a killed run's records (module docstring)."""
    steps, faults = records(run), records(run, FAULTS)
    (fault,) = faults
    starts = [r for r in steps if r["event"] == "start"]
    before = [r for r in steps if r["event"] == "step" and r["restart"] == 0]
    after = [r for r in steps if r["event"] == "step" and r["restart"] > 0]
    resumed = starts[-1]
    return {
        "phase": fault["phase"],
        "killed_at_step": fault["step"],
        "resumed_from_step": resumed["step"],
        "resumed_from": resumed["ckpt"],
        "steps_lost": fault["step"] - resumed["step"],
        "mttr_s": after[0]["time"] - fault["time"],
        "world_before": before[-1]["world"],
        "world_after": after[-1]["world"],
        "tokens_per_s_before": _rate(before),
        "tokens_per_s_after": _rate(after),
        "final_step": after[-1]["step"],
    }


def _rate(steps: list[dict[str, Any]], skip: int = 3) -> float:
    """Tokens per second over ``steps`` (the first ``skip`` are warm-up: imports, first collectives)."""
    steady = steps[skip:] if len(steps) > skip + 2 else steps
    seconds = steady[-1]["time"] - steady[0]["time"]
    return sum(r["tokens"] for r in steady[1:]) / seconds if seconds > 0 else float("nan")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
