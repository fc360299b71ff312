"""Start several processes as the ranks of one job on this machine (what torchrun does, minus the agent).

Used by ``dynmo-bench`` (and the tests) to run many configurations in one set of processes: importing Lightning
costs seconds per process, so a launch runs a list of cases back to back in the same world.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from dynmo_lightning.pipeline.groups import open_store

#: Variables that describe a distributed job; a launch sets its own, never inherits a parent job's.
DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "GLOBAL_RANK",
    "RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
)

#: How long the launcher's rendezvous store waits for a rank.
_STORE_TIMEOUT = timedelta(minutes=5)


class LocalJob(list):
    """The processes of a job started by :func:`start_ranks` (a list of ``Popen``), and the store they meet at.

    The launching process hosts the job's rendezvous store, as torchrun's agent does: it listens on a port the OS
    picked when it was opened, so no other process can take the port between choosing it and using it.
    """

    def __init__(self, procs: list[subprocess.Popen], store: Any) -> None:
        super().__init__(procs)
        self.store = store


def clean_env() -> dict[str, str]:
    """This process's environment without distributed settings, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def start_ranks(world_size: int, argv: Sequence[str], *, log_dir: Path, tag: str) -> LocalJob:
    """Start ``argv`` in ``world_size`` processes with ranks 0..N-1 (output to ``log_dir/{tag}.rank{r}.log``).

    Every process gets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``LOCAL_RANK``, so Lightning sees externally
    started processes, and meets the others at the store this process hosts (``TORCHELASTIC_USE_AGENT_STORE``, as
    under torchrun); keep the returned job referenced until its processes are done.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    store = open_store("127.0.0.1", _STORE_TIMEOUT)
    procs = []
    for rank in range(world_size):
        env = {
            **clean_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "LOCAL_RANK": str(rank),
        }
        with open(log_dir / f"{tag}.rank{rank}.log", "w") as log:  # the child keeps its own handle
            procs.append(subprocess.Popen(list(argv), env=env, stdout=log, stderr=subprocess.STDOUT))
    return LocalJob(procs, store)


def run_ranks(
    world_size: int,
    argv: Sequence[str],
    *,
    log_dir: Path,
    tag: str,
    timeout: float,
    poll: Callable[[], None] | None = None,
) -> list[int | None]:
    """Run ``argv`` in ``world_size`` processes (see :func:`start_ranks`) and wait; returns their exit codes.

    On timeout every process is killed and every code is ``None``. ``poll`` is called every few seconds while
    waiting (progress reports).
    """
    procs = start_ranks(world_size, argv, log_dir=log_dir, tag=tag)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if poll is not None:
            poll()
        time.sleep(2.0 if poll is not None else 0.2)
    timed_out = any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if poll is not None:
        poll()
    return [None if timed_out else p.returncode for p in procs]
