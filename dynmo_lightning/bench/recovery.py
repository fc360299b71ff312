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
import random
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from dynmo_lightning.pipeline.checkpoint.resume import restart_count

#: The workers' record of every step (global rank 0 of each world writes it).
STEPS = "steps.jsonl"
#: The fault's record (:class:`~dynmo_lightning.bench.kills.KillAt`).
FAULTS = "faults.jsonl"
#: How long each checkpoint save held the training thread (global rank 0).
SAVES = "saves.jsonl"


def _time_saves(strategy: Any, path: Path) -> None:
    """Record how long every ``save_checkpoint`` holds the training thread (on this strategy object only)."""
    save = strategy.save_checkpoint

    def timed(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        save(*args, **kwargs)
        if strategy.global_rank == 0:
            with path.open("a") as f:
                f.write(json.dumps({"seconds": time.perf_counter() - started}) + "\n")

    strategy.save_checkpoint = timed


class StepClock(pl.Callback):
    """Appends ``{"restart", "world", "step", "time", "tokens"}`` per step, and a ``"start"`` record per fit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.restart = restart_count()

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
    from dynmo_lightning.launch import torchrun_num_nodes
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
    p.add_argument("--epoch-steps", type=int, default=None)
    p.add_argument("--kills", default="[]", help="JSON list of {attempt, rank, step, phase}: a process kill each")
    p.add_argument("--time-saves", action="store_true", help="record the training thread's time in every save")
    a = p.parse_args(argv)
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=a.run / "checkpoints", save_last=True, save_top_k=-1, every_n_train_steps=a.every),
        StepClock(a.run / STEPS),
    ]
    if a.kill_step and os.environ.get("DYNMO_NODE") == "B" and os.environ["LOCAL_RANK"] == "0":
        rank = int(os.environ["RANK"])
        callbacks.append(KillAt(rank, a.kill_step, a.phase, scope="node", record=a.run / FAULTS))
    attempt = restart_count()
    for kill in json.loads(a.kills):
        if kill["attempt"] == attempt:  # this attempt's fault (a soak: one per attempt)
            callbacks.append(KillAt(kill["rank"], kill["step"], kill["phase"], record=a.run / FAULTS, every_start=True))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=torchrun_num_nodes(),  # an elastic job's nodes: what the rendezvous gave
        strategy=DynMoStrategy(n_microbatches=4, heartbeat_timeout=a.heartbeat, async_checkpoint=bool(a.background)),
        max_steps=a.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        limit_train_batches=a.epoch_steps,
    )
    if a.time_saves:
        _time_saves(trainer.strategy, a.run / SAVES)
    model = GPT(n_layer=a.layers, n_embd=a.width, n_head=4, block_size=32)
    data = StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=400_000)
    trainer.fit(model, datamodule=data, ckpt_path=a.ckpt)


def torchrun(
    run: Path, node: str, nnodes: str, nproc: int, port: int, args: list[str], max_restarts: int,
    env: dict[str, str] | None = None,
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
    env = {**clean_env(), "DYNMO_NODE": node, **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_job(
    run: Path, nodes: int, nproc: int, args: list[str], *, timeout: float = 900, max_restarts: int = 3
) -> list[int]:
    """Run one job of ``nodes`` loopback nodes (``--nnodes=1:nodes``) to its end; their agents' exit statuses."""
    from dynmo_lightning.pipeline.elastic.survivors import open_store

    run.mkdir(parents=True, exist_ok=True)
    store = open_store("127.0.0.1", timedelta(minutes=30))  # the rendezvous host: outlives the nodes
    agents = [torchrun(run, "AB"[n], f"1:{nodes}", nproc, store.port, args, max_restarts) for n in range(nodes)]
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


def restart_row(work: Path, phase: str, *, background: bool = False, width: int = 64) -> dict[str, Any]:
    """One ``tier="restart"`` row: a node killed at step 30 of 60 in ``phase``, then the by-hand reference."""
    tag = f"{phase}-{'background' if background else 'blocking'}"
    run, ref = work / tag, work / f"{tag}-by-hand"
    common = ["--steps", "60", "--every", "10", "--width", str(width), "--background", str(int(background))]
    codes = run_job(run, 2, 2, [*common, "--kill-step", "30", "--phase", phase])
    facts = measure(run)
    resumed = run / "checkpoints" / f"epoch=0-step={facts['resumed_from_step']}.ckpt"
    ref_codes = run_job(ref, 1, 2, [*common, "--ckpt", str(resumed)])
    exact = codes[0] == 0 and ref_codes == [0] and same_state(run / "checkpoints" / "last.ckpt",
                                                                ref / "checkpoints" / "last.ckpt")  # fmt: skip
    ideal = facts["tokens_per_s_before"] * facts["world_after"] / facts["world_before"]
    return {"tier": "restart", "phase": phase, "background_checkpoints": background, **facts,
            "ideal_tokens_per_s_after": ideal, "after_over_ideal": facts["tokens_per_s_after"] / ideal,
            "exact": exact, "agents_exit": codes}  # fmt: skip


def same_state(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold bit-identical weights, optimizer state and step."""
    import torch

    from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

    x, y = load_whole(a), load_whole(b)
    if x["global_step"] != y["global_step"] or x["state_dict"].keys() != y["state_dict"].keys():
        return False
    same = all(torch.equal(v, y["state_dict"][k]) for k, v in x["state_dict"].items())
    ox, oy = x["optimizer_states"][0]["state"], y["optimizer_states"][0]["state"]
    return same and all(torch.equal(v, oy[n][k]) for n, s in ox.items() for k, v in s.items() if torch.is_tensor(v))


def overhead(work: Path, repeats: int, every: int, width: int) -> list[dict[str, Any]]:
    """Mean step time with checkpoints every ``every`` steps, blocking or in the background, against none.

    One node of 2 workers, 40 steps; the modes alternate within each repeat (none, blocking, background, then the
    next repeat) so that drift of the machine falls on all alike. Steps 5 to 40 count (start-up excluded).
    """
    rows = []
    for r in range(repeats):
        for mode in ("none", "blocking", "background"):
            run = work / f"overhead-{mode}-{r}"
            args = ["--steps", "40", "--width", str(width), "--every", str(every if mode != "none" else 10_000),
                    "--background", str(int(mode == "background")), "--time-saves"]  # fmt: skip
            assert run_job(run, 1, 2, args) == [0], run
            times = [rec["time"] for rec in records(run) if rec["event"] == "step"][4:]
            held = [rec["seconds"] for rec in records(run, SAVES)]
            rows.append({"mode": mode, "repeat": r, "step_s": (times[-1] - times[0]) / (len(times) - 1),
                         "save_held_s": sum(held) / len(held) if held else 0.0})  # fmt: skip
    return rows


def overhead_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: mean step time, its ratio to no checkpoints (paired by repeat) and a save's hold on training."""
    import statistics

    by = {(r["mode"], r["repeat"]): r["step_s"] for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    out: dict[str, Any] = {}
    for mode in ("none", "blocking", "background"):
        ratios = [by[mode, r] / by["none", r] for r in repeats]
        held = [r["save_held_s"] for r in rows if r["mode"] == mode]
        out[mode] = {"step_s": statistics.mean(by[mode, r] for r in repeats), "over_none": statistics.mean(ratios),
                     "range": [min(ratios), max(ratios)], "save_held_s": statistics.mean(held)}  # fmt: skip
    return out


def kill_plan(kills: int, steps: int, every: int, seed: int, ranks: int) -> list[dict[str, Any]]:
    """``kills`` faults, one per attempt of the job, at increasing random steps, random ranks and phases.

    A ``"checkpoint"`` fault can only strike at a step that writes one (a multiple of ``every``); other phases
    strike anywhere. Attempt ``i`` resumes at or before fault ``i - 1``'s step, so it reaches fault ``i``.
    """
    from dynmo_lightning.bench.kills import STEP_PHASES

    rng = random.Random(seed)
    points = sorted(rng.sample(range(3, steps - 2), kills))
    plan = []
    for attempt, step in enumerate(points):
        phases = [p for p in STEP_PHASES if p != "checkpoint" or step % every == 0]  # no balancer in these jobs
        plan.append({"attempt": attempt, "rank": rng.randrange(ranks), "step": step, "phase": rng.choice(phases)})
    return plan


def soak(work: Path, kills: int, steps: int = 120, every: int = 10, seed: int = 0) -> dict[str, Any]:
    """A soak: one node of 2 workers, ``kills`` random process kills, against the same job never killed.

    Epochs are ``every`` steps long and a checkpoint ends each (a plain DataLoader restarts its epoch on resume:
    at epoch ends a resumed run sees the batches an uninterrupted one does), so the killed job's final state must be
    bit-identical to the uninterrupted job's.
    """
    plan = kill_plan(kills, steps, every, seed, ranks=2)
    run, ref = work / f"soak-{seed}", work / f"soak-{seed}-uninterrupted"
    common = ["--steps", str(steps), "--every", str(every), "--epoch-steps", str(every)]
    started = time.monotonic()
    codes = run_job(run, 1, 2, [*common, "--kills", json.dumps(plan)], max_restarts=kills + 2)
    seconds = time.monotonic() - started
    started = time.monotonic()
    assert run_job(ref, 1, 2, common) == [0], ref
    clean_seconds = time.monotonic() - started
    steps_done, faults = records(run), records(run, FAULTS)
    starts = [r for r in steps_done if r["event"] == "start"]
    lost = [f["step"] - s["step"] for f, s in zip(faults, starts[1:], strict=False)]
    return {"kills_planned": plan, "kills": len(faults), "restarts": len(starts) - 1, "agent_exit": codes[0],
            "final_step": max(r["step"] for r in steps_done), "steps_lost": lost, "seconds": seconds,
            "uninterrupted_seconds": clean_seconds,
            "exact": codes == [0] and same_state(run / "checkpoints" / "last.ckpt", ref / "checkpoints" / "last.ckpt")}


def grow_back(work: Path, steps: int = 60, every: int = 10, kill_step: int = 20, join_at: int = 25) -> dict[str, Any]:
    """A node lost at ``kill_step``, a replacement node started once the survivors reached ``join_at``.

    The survivors' agent sees the new node waiting at the rendezvous and restarts its workers into the grown world,
    whose workers all resume from the run's newest checkpoint (the new node's workers too: they start under torchrun
    and find the run's checkpoints). Returns the worlds of each start, the time from starting the new node to the
    first step of the grown world, the steps the grown world re-ran, and the checkpoint it resumed from.

    The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store shared (torch's default), the agent
    that was rank 0 before keeps its store's address from the earlier round and never publishes it for the new one,
    so a joining node's agent waits for it until the rendezvous times out (torch 2.13's ``next_rendezvous``).
    """
    from dynmo_lightning.pipeline.elastic.survivors import open_store

    run = work / "grow-back"
    run.mkdir(parents=True, exist_ok=True)
    store = open_store("127.0.0.1", timedelta(minutes=30))
    args = ["--steps", str(steps), "--every", str(every), "--kill-step", str(kill_step)]
    unshared = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [torchrun(run, node, "1:2", 2, store.port, args, 3, unshared) for node in "AB"]
    deadline = time.monotonic() + 600
    try:
        _wait_for_survivors(run, join_at, agents[0], deadline)
        joined = time.time()
        agents.append(torchrun(run, "C", "1:2", 2, store.port, args, 3, unshared))
        for agent in (agents[0], agents[2]):
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    return {"exit": [a.returncode for a in agents], **_grown(records(run), joined)}


def _wait_for_survivors(run: Path, step: int, agent: subprocess.Popen, deadline: float) -> None:
    """Wait until the job, shrunk to 2 processes, has completed ``step``."""
    while not any(r["event"] == "step" and r["world"] == 2 and r["step"] >= step for r in records(run)):
        if time.monotonic() > deadline or agent.poll() is not None:
            raise RuntimeError(f"the survivors never reached step {step}: see {run}/nodeA.log")
        time.sleep(0.2)


def _grown(steps: list[dict[str, Any]], joined: float) -> dict[str, Any]:
    """The grow-back's figures from the job's step records (``joined``: when the new node started)."""
    starts = [r for r in steps if r["event"] == "start"]
    grown = [r for r in steps if r["event"] == "step" and r["time"] > joined and r["world"] == 4]
    small = [r["step"] for r in steps if r["event"] == "step" and r["world"] == 2]
    return {"worlds": [s["world"] for s in starts], "join_to_step_s": grown[0]["time"] - joined if grown else None,
            "resumed_from": starts[-1]["ckpt"], "resumed_from_step": starts[-1]["step"],
            "steps_rerun": max(small) - starts[-1]["step"], "final_step": max(r["step"] for r in steps)}  # fmt: skip

def tables(result: dict[str, Any]) -> str:
    """The Markdown tables of docs/reliability.md, from ``recovery.json`` (a test holds the page equal to them)."""
    lines = ["| phase killed | checkpoints | time to the next step | steps lost | tokens/s before → after (ideal) | "
             "exact |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in restart_rows(result):
        lines.append(
            f"| {r['phase']} | {'background' if r['background_checkpoints'] else 'blocking'} | {r['mttr_s']:.1f} s | "
            f"{r['steps_lost']} | {r['tokens_per_s_before']:.0f} → {r['tokens_per_s_after']:.0f} "
            f"({r['ideal_tokens_per_s_after']:.0f}) | {'yes' if r['exact'] else 'NO'} |"
        )
    cost = result["checkpoint_overhead"]["summary"]
    lines += ["", "| checkpoints | step time | over none (range over repeats) | a save holds training |",
              "| --- | --- | --- | --- |"]  # fmt: skip
    for mode in ("none", "blocking", "background"):
        c = cost[mode]
        held = f"{c['save_held_s'] * 1e3:.0f} ms" if mode != "none" else "-"
        lines.append(f"| {mode} | {c['step_s'] * 1e3:.0f} ms | {c['over_none']:.2f}x [{c['range'][0]:.2f}, "
                     f"{c['range'][1]:.2f}] | {held} |")  # fmt: skip
    s = result["soak"]
    lost = ", ".join(str(n) for n in s["steps_lost"])
    lines += ["", f"Soak: {s['kills']} kills, {s['restarts']} restarts, final step {s['final_step']}, steps lost per "
              f"kill {lost}; {s['seconds']:.0f} s against {s['uninterrupted_seconds']:.0f} s uninterrupted; "
              f"bit-identical to the uninterrupted job: {'yes' if s['exact'] else 'NO'}."]  # fmt: skip
    g = result["grow_back"]
    lines += ["", f"Grow back: worlds {' → '.join(str(w) for w in g['worlds'])}; from starting the new node to the "
              f"grown world's first step {g['join_to_step_s']:.1f} s, {g['steps_rerun']} steps re-run (resumed at "
              f"step {g['resumed_from_step']}), final step {g['final_step']}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def restart_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The restart tier's rows of ``recovery.json`` (the in-place tier's are ``bench/in_place.py``'s)."""
    return [r for r in result["rows"] if r.get("tier", "restart") == "restart"]


def front_page(result: dict[str, Any]) -> str:
    """The README's sentence on recovery, from ``recovery.json`` (a test holds the README equal to it)."""
    rows, soaked = restart_rows(result), result["soak"]
    mttr = [r["mttr_s"] for r in rows]
    lost = sorted({r["steps_lost"] for r in rows})
    exact = "bit-identical" if all(r["exact"] for r in rows) else "NOT identical"
    return (
        "**Recovery** (a node of 2 CPU processes killed under torchrun's elastic agent, in each phase of a step; "
        "[docs/reliability.md](docs/reliability.md#recovery-by-restart)): the job restarts on the survivors, resumes "
        f"from its newest checkpoint by itself and ends {exact} to a run resumed by hand, "
        f"**{min(mttr):.0f}\u2013{max(mttr):.0f} s** from the kill to the next step (a fresh interpreter on every "
        "worker), "
        f"{lost[0]} steps lost ({lost[-1]} when the kill interrupts a checkpoint); a soak of {soaked['kills']} random "
        f"kills ends {'bit-identical' if soaked['exact'] else 'NOT identical'} to the job never killed."
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m dynmo_lightning.bench.recovery --out docs/bench``: the restart tier's rows and the overhead."""
    from dynmo_lightning.bench.kills import STEP_PHASES

    p = argparse.ArgumentParser(prog="python -m dynmo_lightning.bench.recovery")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--work", type=Path, default=Path("bench/recovery"))
    p.add_argument("--phases", nargs="*", default=list(STEP_PHASES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--overhead-width", type=int, default=256)
    p.add_argument("--soak-kills", type=int, default=10)
    a = p.parse_args(argv)
    rows = [restart_row(a.work, phase) for phase in a.phases]
    rows += [restart_row(a.work, phase, background=True) for phase in ("step", "checkpoint")]
    cost = overhead(a.work, a.repeats, a.every, a.overhead_width)
    soaked = soak(a.work, a.soak_kills)
    grown = grow_back(a.work)
    result = {
        "command": "python -m dynmo_lightning.bench.recovery " + " ".join(argv if argv is not None else sys.argv[1:]),
        "setup": "2 loopback nodes x 2 CPU processes (torchrun elastic agents, --nnodes=1:2, --max-restarts=3, "
        "last_call_timeout=5 s), GPT 8 blocks width 64, batch 8 x 32 tokens, 4 micro-batches, 1F1B, AdamW; node B "
        "killed (SIGKILL, agent and workers) at step 30 of 60, sharded checkpoints every 10 steps",
        "rows": rows,
        "checkpoint_overhead": {"every_n_steps": a.every, "width": a.overhead_width, "runs": cost,
                                "summary": overhead_summary(cost)},
        "soak": soaked,
        "grow_back": grown,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "recovery.json"
    if path.exists():  # the in-place tier's rows and facts (python -m dynmo_lightning.bench.in_place) stay
        earlier = json.loads(path.read_text())
        result["rows"] += [r for r in earlier["rows"] if r.get("tier") == "in_place"]
        if "in_place" in earlier:
            result["in_place"] = earlier["in_place"]
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"rows": [{k: r[k] for k in ("phase", "background_checkpoints", "mttr_s", "steps_lost",
                                                   "after_over_ideal", "exact")} for r in rows],
                      "overhead": result["checkpoint_overhead"]["summary"],
                      "soak": {k: v for k, v in soaked.items() if k != "kills_planned"}, "grow_back": grown},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    else:
        main()
