"""Give released resources back to the job manager: which ranks and whole nodes a consolidation freed, and handlers.

After a shrink (``strategy.pipeline_control.shrink``), rank 0 of the new world describes the release as a
:class:`ReleaseEvent` and calls a :class:`ReleaseHandler` with it; what the handler returns (environment variables
for the job's later steps) is applied on every survivor. Built in:

- ``"slurm"`` (:class:`SlurmRelease`): shrinks the allocation to the kept nodes with
  ``scontrol update JobId=<id> NodeList=<kept nodes>``; Slurm then writes ``slurm_job_<id>_resize.sh`` (the
  environment of the resized job) into the working directory, whose ``export``/``unset`` lines the survivors apply.
- ``"command"`` (:class:`CommandRelease`): runs a shell command with the event as JSON on its standard input (LSF's
  ``bresize release``, a cloud API, a notification).
- ``"none"`` (:class:`NoRelease`): nothing (processes exit; the scheduler reclaims their resources when the job ends).

A handler's failure is logged and never stops training: a scheduler that refuses to shrink costs idle resources,
not the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: Handlers selectable by name (``balancer.release_to``).
RELEASE_TO = ("none", "slurm", "command")

#: Seconds a handler's command may run before it is abandoned (training waits for it on rank 0).
COMMAND_TIMEOUT = 60.0


def node_name() -> str:
    """This process's node as the job manager names it: Slurm's ``SLURMD_NODENAME``, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class ReleaseEvent:
    """What one consolidation released.

    Attributes:
        step: optimizer steps done when it happened.
        released_ranks: global ranks (in the world before) that left.
        released_hosts: their nodes' names, in the same order.
        freed_nodes: names of the nodes on which no process of the job runs any more (the scheduler may take them).
        kept_nodes: names of the nodes the survivors run on, in the order of their new node ranks.
        world_size_before: processes before the release.
        world_size_after: processes after it.
        slow_pipeline_ranks: the released pipeline ranks (of the pipeline before) that were measured slow, with
            their relative speed (1: the fastest process): stragglers a job manager may want to replace. With
            replicas a pipeline rank's speed is its slowest replica's.
    """

    step: int
    released_ranks: list[int]
    released_hosts: list[str]
    freed_nodes: list[str]
    kept_nodes: list[str]
    world_size_before: int
    world_size_after: int
    slow_pipeline_ranks: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """The event as one JSON object (what ``"command"`` handlers read on their standard input)."""
        return json.dumps(dataclasses.asdict(self))


class ReleaseHandler(Protocol):
    """Tells the job manager about a release; returns environment variables for the survivors (``None``: unset)."""

    def __call__(self, event: ReleaseEvent) -> Mapping[str, str | None] | None:
        """Act on ``event``; may raise (the failure is logged, training goes on)."""
        ...


class NoRelease:
    """Tell nobody: released processes exit, their resources return to the scheduler when the job ends."""

    def __call__(self, event: ReleaseEvent) -> None:
        """Do nothing."""
        return None


class CommandRelease:
    """Run ``command`` through the shell with the event as JSON on its standard input.

    Args:
        command: the shell command (e.g. ``"bresize release -J $LSB_JOBID ..."`` or a script of yours).
        timeout: seconds it may run.
    """

    def __init__(self, command: str, timeout: float = COMMAND_TIMEOUT) -> None:
        if not command or not command.strip():
            raise ValueError("balancer.release_to=command needs balancer.release_command (a shell command)")
        self.command, self.timeout = command, timeout

    def __call__(self, event: ReleaseEvent) -> None:
        """Run the command; raises on a non-zero exit status (logged by :func:`notify`)."""
        proc = subprocess.run(
            self.command, shell=True, input=event.to_json(), capture_output=True, text=True, timeout=self.timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(f"`{self.command}` exited with status {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return None


class SlurmRelease:
    """Shrink the Slurm allocation to the nodes that still run the job.

    Args:
        job_id: the job (default: ``SLURM_JOB_ID`` of the environment).
        scontrol: the ``scontrol`` executable.
        workdir: where Slurm writes ``slurm_job_<id>_resize.sh`` (the current directory of ``scontrol``).
        timeout: seconds ``scontrol`` may run.
    """

    def __init__(
        self,
        job_id: str | None = None,
        scontrol: str = "scontrol",
        workdir: str | os.PathLike[str] | None = None,
        timeout: float = COMMAND_TIMEOUT,
    ) -> None:
        self.job_id, self.scontrol, self.timeout = job_id, scontrol, timeout
        self.workdir = Path(workdir) if workdir is not None else None

    def __call__(self, event: ReleaseEvent) -> dict[str, str | None] | None:
        """Run ``scontrol update``; returns the resize script's environment for the survivors."""
        job = self.job_id or os.environ.get("SLURM_JOB_ID")
        if not job:
            raise RuntimeError("balancer.release_to=slurm outside a Slurm job: SLURM_JOB_ID is not set")
        if event.slow_pipeline_ranks:  # stragglers: what an operator may want to drain or replace
            log.warning("DynMo release: slow processes released (pipeline rank: speed) %s, on hosts %s",
                        event.slow_pipeline_ranks, event.released_hosts)  # fmt: skip
        if not event.freed_nodes:
            log.info("DynMo release: no whole node is free (ranks %s left), the Slurm job keeps its nodes",
                     event.released_ranks)  # fmt: skip
            return None
        workdir = self.workdir or Path.cwd()
        cmd = [self.scontrol, "update", f"JobId={job}", f"NodeList={','.join(event.kept_nodes)}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout, cwd=workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited with status {proc.returncode}: {proc.stderr.strip()[-500:]}")
        script = workdir / f"slurm_job_{job}_resize.sh"
        return parse_resize_script(script.read_text()) if script.is_file() else None


def parse_resize_script(text: str) -> dict[str, str | None]:
    """The environment a Slurm resize script sets: ``export K=V`` lines (quotes removed) and ``unset K`` (``None``)."""
    env: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"export\s+([A-Za-z_]\w*)=(.*?);?", line):
            value = shlex.split(m.group(2))
            env[m.group(1)] = value[0] if value else ""
        elif m := re.fullmatch(r"unset\s+([A-Za-z_]\w*);?", line):
            env[m.group(1)] = None
    return env


def make_release_handler(release_to: str | ReleaseHandler, release_command: str | None = None) -> ReleaseHandler:
    """The handler named ``release_to`` (:data:`RELEASE_TO`), or ``release_to`` itself when it is a callable."""
    if callable(release_to):
        return release_to
    if release_to == "none":
        return NoRelease()
    if release_to == "slurm":
        return SlurmRelease()
    if release_to == "command":
        return CommandRelease(release_command or "")
    raise ValueError(f"balancer.release_to={release_to!r} is not one of {list(RELEASE_TO)} (or a callable)")


def notify(handler: ReleaseHandler, event: ReleaseEvent) -> dict[str, str | None]:
    """Call ``handler``; its failure is logged, never raised. Returns the environment to apply (maybe empty)."""
    try:
        env = handler(event)
    except Exception as err:  # a scheduler's refusal must not stop training
        log.warning("DynMo release handler %s failed (training goes on): %s", type(handler).__name__, err)
        return {}
    log.info("DynMo released ranks %s; whole nodes freed: %s", event.released_ranks, event.freed_nodes or "none")
    return dict(env or {})


def apply_environment(env: Mapping[str, Any]) -> None:
    """Set (or, for ``None``, unset) the variables in this process's environment."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)


def describe(step: int, order: list[int], hosts: list[tuple[int, str]], world_before: int) -> ReleaseEvent:
    """The release of a shrink to the survivors ``order`` (old global ranks), from every old rank's node.

    Args:
        step: optimizer steps done.
        order: the old global ranks that stay, in the order of their new ranks.
        hosts: ``(node rank, node name)`` of every old global rank.
        world_before: processes before the shrink.
    """
    released = [g for g in range(world_before) if g not in order]
    kept = list(dict.fromkeys(hosts[g] for g in order))
    freed = [node for node in dict.fromkeys(hosts[g] for g in released) if node not in kept]
    return ReleaseEvent(
        step=step,
        released_ranks=released,
        released_hosts=[hosts[g][1] for g in released],
        freed_nodes=[name for _, name in freed],
        kept_nodes=[name for _, name in kept],
        world_size_before=world_before,
        world_size_after=len(order),
    )
