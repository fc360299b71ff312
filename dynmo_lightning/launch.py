"""Processes as the ranks of one job on this machine (torchrun minus the agent); a world of its own per Trainer call.

Used by ``dynmo-bench`` (and the tests) to run many configurations in one set of processes: importing Lightning
costs seconds per process, so a launch runs a list of cases back to back, each in a fresh world
(:func:`fresh_world`, from :mod:`dynmo_lightning.pipeline.elastic.lifetimes`, which the runtime uses too: the import
runs downwards).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dynmo_lightning.pipeline.elastic.lifetimes import _STORE_TIMEOUT, DIST_ENV, FIT_ENV, end_world_at_exit, fresh_world
from dynmo_lightning.pipeline.elastic.survivors import open_store

__all__ = ["DIST_ENV", "FIT_ENV", "LocalJob", "backend_device", "clean_env", "end_world_at_exit", "fresh_world",
           "run_ranks", "start_ranks", "torchrun_num_nodes"]  # fmt: skip


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


def torchrun_num_nodes(default: int = 1) -> int:
    """The Trainer's ``num_nodes`` for this world: under torchrun, the nodes its rendezvous gave; else ``default``.

    An elastic job (``torchrun --nnodes=MIN:MAX``) restarted on fewer nodes has a smaller ``WORLD_SIZE``, and
    Lightning refuses a Trainer whose ``devices * num_nodes`` differs from it: pass ``num_nodes=torchrun_num_nodes()``
    (``dynmo-train`` does) so that the restarted job resumes on the world it got.
    """
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not world or not local:
        return default
    return max(1, int(world) // int(local))
