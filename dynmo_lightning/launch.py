"""Processes as the ranks of one job on this machine (torchrun minus the agent); a world of its own per Trainer call.

Used by ``dynmo-bench`` (and the tests) to run many configurations in one set of processes: importing Lightning
costs seconds per process, so a launch runs a list of cases back to back, each in a fresh world
(:func:`fresh_world`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dynmo_lightning.pipeline.groups import host_stores, open_store

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

#: What a Trainer call leaves in the environment of its process: the variables Lightning's launcher and
#: ``_init_dist_connection`` export (rendezvous, ranks), ``seed_everything``'s (``PL_*``), the thread count and cuBLAS
#: workspace Lightning sets when they are unset, and those a world change of the strategy sets (``WorldView``).
FIT_ENV = (
    *DIST_ENV,
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "OMP_NUM_THREADS",
    "CUBLAS_WORKSPACE_CONFIG",
)

#: How long the launcher's rendezvous store waits for a rank.
_STORE_TIMEOUT = timedelta(minutes=5)

#: The rendezvous store of the next world, opened by rank 0 when a world of processes that go on together ended
#: (:func:`fresh_world`); kept open until that world ends too.
_next_store: dist.TCPStore | None = None


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


@contextlib.contextmanager
def fresh_world() -> Iterator[None]:
    """Run one Trainer call (``fit``, ``validate``, ...) in a world of its own.

    Lightning's ``_init_dist_connection`` returns early when a process group exists, and nothing destroys it after
    ``fit``: a second Trainer in the same process would inherit the first one's world, its backend (NCCL or gloo)
    and its devices included. On exit this ends the default process group, if any, and puts the variables of
    :data:`FIT_ENV` back as they were on entry (with ``LOCAL_RANK`` left behind, the next Trainer would take its
    process for one started from outside and wait for ranks nobody starts).

    Processes started from outside (torchrun, :func:`start_ranks`) go on together into the next world. Its
    rendezvous cannot reuse the launcher's store, which still holds the old world's keys (the new default group
    would read them and connect to closed ports), so on a normal exit of a world of several processes rank 0 opens
    a new store and every process points ``MASTER_PORT`` at it (all of them join it as clients, as under torchrun's
    agent). Every process of the world must use this context around the same calls.
    """
    saved = {k: os.environ.get(k) for k in FIT_ENV}
    external = "LOCAL_RANK" in os.environ  # started from outside: its ranks go on together
    try:
        yield
    except BaseException:
        _end_world(saved)  # the other processes may be anywhere: no collective now
        raise
    store, env = None, {}
    if dist.is_initialized() and (dist.get_world_size() > 1 or external):
        store, env = _next_rendezvous()  # every process of the world takes part, whoever started it
    if not external:  # it started its world's processes itself: the next call starts new ones
        store, env = None, {}
    _end_world(saved, env, store)


def _next_rendezvous() -> tuple[dist.TCPStore | None, dict[str, str]]:
    """Open the next world's store on rank 0 of the current one (collective); the variables that lead to it."""
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    stores, ports = host_stores(1, address, _STORE_TIMEOUT)
    return stores[0], {"MASTER_ADDR": address, "MASTER_PORT": str(ports[0]), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _end_world(saved: dict[str, str | None], env: dict[str, str] | None = None, store: Any = None) -> None:
    """Destroy the default process group; restore the environment, pointed at the next world's store if any."""
    global _next_store
    if dist.is_initialized():
        dist.destroy_process_group()
    _next_store = store  # the store the ended world met at (if this process hosted one) closes now
    for key, value in {**saved, **(env or {})}.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_ends_at_exit = False


def end_world_at_exit() -> None:
    """At interpreter exit, end this process's world first, in order (registered once per process).

    Left to the interpreter's shutdown, the process group and the stores this process hosts are torn down in no
    particular order while their threads may still run, and a job that trained and checkpointed can still abort at
    exit ("terminate called without an active exception": a status a scheduler reports as failed). ``atexit`` runs
    before that, with every thread alive: the default group (and with it every subgroup) is destroyed, then the store
    kept for a next world is closed.
    """
    global _ends_at_exit
    if not _ends_at_exit:
        atexit.register(_end_at_exit)
        _ends_at_exit = True


def _end_at_exit() -> None:
    global _next_store
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _next_store = None


def backend_device(backend: str | None = None) -> torch.device:
    """The device the tensors a process sends over ``backend`` must live on.

    NCCL sends from this process's GPU (``torch.cuda.current_device()``, which Lightning sets to the rank's device);
    gloo, the other backend of a CPU build, sends CPU tensors only. A per-device backend such as
    ``"cpu:gloo,cuda:nccl"`` counts as NCCL: a pipeline's activations travel on the GPU.

    Args:
        backend: a process group backend; by default the default process group's.
    """
    name = str(backend if backend is not None else dist.get_backend())
    if "nccl" in name:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
