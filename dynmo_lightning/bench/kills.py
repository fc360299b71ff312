"""A fault for benchmarks and tests, as torchft injects them: a process (or its whole node) killed at a step and phase.

:class:`KillAt` is a Lightning callback on every process; on ``rank`` at training step ``step`` it kills, in the
named ``phase``: ``"step"`` (before the step's first forward), ``"forward"`` (inside the first forward of a layer of
this process in that step), ``"backward"`` (inside the first backward of such a layer), ``"optimizer"`` (before the
optimizer step), ``"checkpoint"`` (inside the save of a checkpoint at that step, before its files are written),
``"migration"`` or ``"consolidation"`` (in this process's first layer transfer of a balancer's migration, or of a
consolidation, at that step: its tensors not yet sent or received), ``"copies"`` (under ``fsdp`` with
``on_peer_lost="recover"``: after the step's optimizer update, as this process starts to exchange its shards' copies).
``signal="KILL"`` is a crash (``SIGKILL``: nothing runs after it), ``"STOP"`` a hang (``SIGSTOP``: the process is
there but silent, as a wedged device or a network partition looks). ``scope="node"`` kills the node: under
torchrun's elastic agent, the agent that started this process and every process it started (their parent's other
children, read from ``/proc``, Linux only), as a lost machine takes everything on it.

Before it kills, it appends ``{"rank", "step", "phase", "time"}`` to ``record`` (a JSON-lines file), which the
recovery benchmark reads to time the recovery from the moment of the fault. For benchmarks and tests only.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from dynmo_lightning.pipeline.checkpoint.resume import restart_count

#: Where in a step a fault can strike.
STEP_PHASES = ("step", "forward", "backward", "optimizer", "checkpoint")
#: ... and where it can strike in a balancer's work (a job that migrates or consolidates), and in the exchange of
#: FSDP2's shards' copies after an optimizer step (``on_peer_lost="recover"`` under ``fsdp``: the step is applied).
PHASES = (*STEP_PHASES, "migration", "consolidation", "copies")


def node_processes(agent: int | None = None) -> list[int]:
    """The processes of this process's node under torchrun: the agent (its parent) and the agent's children."""
    agent = os.getppid() if agent is None else agent
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            if int(fields[1]) == agent:
                children.append(int(entry.name))
    return [agent, *children]


class KillAt(Callback):
    """Kill this process (or its node) at a training step and phase (module docstring).

    Args:
        rank: the global rank that is killed (of the world the job starts with: a restart does not kill again unless
            ``every_start``, and a process renumbered by a recovery without restart is not taken for it).
        step: the training step (``trainer.global_step`` when the step starts).
        phase: one of :data:`PHASES`.
        scope: ``"process"`` or ``"node"``.
        signal: ``"KILL"`` or ``"STOP"``.
        record: JSON-lines file the fault's time is appended to.
        every_start: kill also after a restart of the job (``resume.restart_count()`` > 0).
    """

    def __init__(
        self,
        rank: int,
        step: int,
        phase: str = "step",
        *,
        scope: str = "process",
        signal: str = "KILL",
        record: str | os.PathLike[str] | None = None,
        every_start: bool = False,
    ) -> None:
        if phase not in PHASES:
            raise ValueError(f"KillAt(phase={phase!r}): one of {list(PHASES)}")
        if scope not in ("process", "node"):
            raise ValueError(f"KillAt(scope={scope!r}): 'process' or 'node'")
        if signal not in ("KILL", "STOP"):
            raise ValueError(f"KillAt(signal={signal!r}): 'KILL' or 'STOP'")
        if scope == "node" and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise ValueError("KillAt(scope='node') needs torchrun's elastic agent (the node is the agent's processes)")
        self.rank, self.step, self.phase, self.scope, self.signal = rank, step, phase, scope, signal
        self.record = None if record is None else Path(record)
        self.armed = every_start or restart_count() == 0
        self._step = -1  # the training step in progress
        self._stepped = False  # its optimizer step began
        self._origin: int | None = None  # this process's rank when training started

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._origin is None:
            self._origin = trainer.global_rank
        if self.phase in ("migration", "consolidation") and self._origin == self.rank:
            self._strike_in_transfers(trainer)
        if self.phase == "copies" and self._origin == self.rank:
            self._strike_in_copies(trainer)

    def _strike_in_transfers(self, trainer: pl.Trainer) -> None:
        """Strike in the first layer transfer (tensors sent or received) of a migration / consolidation when due.

        Both move layers through :mod:`~dynmo_lightning.pipeline.topology.transport`; the job's phase (the name
        failure messages give) tells which of the two is running.
        """
        from dynmo_lightning.pipeline.topology import transport

        world = trainer.strategy.pipeline_control.world
        def in_phase() -> bool:
            watchdog = world.heartbeats.watchdog
            doing = (watchdog.current if watchdog is not None else None) or ""
            # a consolidation's phase names its layer migration too
            return doing.startswith("consolidation" if self.phase == "consolidation" else "layer migration")

        def striking(transfer: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if self.armed and self._step == self.step and in_phase():
                    self.strike()
                return transfer(*args, **kwargs)

            return call

        transport.send_tensors = striking(transport.send_tensors)
        transport.recv_tensors = striking(transport.recv_tensors)

    def _strike_in_copies(self, trainer: pl.Trainer) -> None:
        """Strike as this process starts the exchange of its shards' copies after the optimizer step, when due."""
        in_place = trainer.strategy.pipeline_control.resizer.in_place
        if in_place is None:
            raise ValueError("KillAt(phase='copies') needs on_peer_lost='recover' under data_parallel='fsdp'")
        mirror = in_place.mirror
        exchange = mirror.exchange

        def striking(*args: Any, **kwargs: Any) -> Any:
            if self.armed and self._step == self.step and self._stepped:
                self.strike()
            return exchange(*args, **kwargs)

        mirror.exchange = striking

    def _due(self, trainer: pl.Trainer, phase: str) -> bool:
        return self.armed and phase == self.phase and self._origin == self.rank and self._step == self.step

    def strike(self) -> None:
        """Record the fault, then kill (never returns for ``KILL``; a stopped process resumes only on ``SIGCONT``)."""
        if self.record is not None:
            fact = {"rank": self.rank, "step": self.step, "phase": self.phase, "time": time.time()}
            with self.record.open("a") as f:
                f.write(json.dumps(fact) + "\n")
        sig = signal.SIGKILL if self.signal == "KILL" else signal.SIGSTOP
        victims = node_processes() if self.scope == "node" else []
        for pid in [p for p in victims if p != os.getpid()]:  # the agent first: it must not restart anything
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), sig)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._step, self._stepped = trainer.global_step, False
        if self._due(trainer, "step"):
            self.strike()
        if self._due(trainer, "forward") or self._due(trainer, "backward"):
            layers = [m for m in pl_module.modules() if any(True for _ in m.parameters(recurse=False))]
            if not layers:
                raise RuntimeError(f"KillAt(phase={self.phase!r}): rank {self.rank} holds no layer with parameters")
            if self.phase == "forward":
                layers[0].register_forward_pre_hook(lambda *_: self.strike())
            else:
                layers[-1].register_full_backward_pre_hook(lambda *_: self.strike())

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stepped = True
        if self._due(trainer, "optimizer"):
            self.strike()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        # Lightning calls this while it builds the checkpoint, before the strategy writes anything.
        self._step = trainer.global_step
        if self._due(trainer, "checkpoint"):
            self.strike()
