"""The worlds a process runs in one after the other: a fresh one per Trainer call, all ended in order at exit.

Lightning's ``_init_dist_connection`` keeps the first process group it made; a process that runs several Trainer
calls (``dynmo-train``'s fit then test, a benchmark's cases) needs each in a world of its own (:func:`fresh_world`),
and a process that trained must end its world before the interpreter tears it down (:func:`end_world_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dynmo_lightning.pipeline.elastic.survivors import host_stores, open_store
from dynmo_lightning.pipeline.topology.pending import end_default_group

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
    global _next_store, _world_store
    end_default_group()
    _world_store = None  # a torchrun world's own store (rank 0): the next world opens its own
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
    global _next_store, _world_store
    if dist.is_available():
        end_default_group()
    _next_store = _world_store = None


#: The store this process hosts for its torchrun world (rank 0): open as long as the world.
_world_store: Any = None

#: Key of torchrun's shared store under which rank 0 names its world's own store: ``host:port:nonce``.
WORLD_STORE_KEY = "dynmo/world_store"


def torchrun_world_store(timeout: timedelta) -> dist.Store | None:
    """A store of this world's own for a torchrun worker's process group (``None`` when not under torchrun).

    torchrun's agents share one store with the workers of every world they form (``TORCHELASTIC_USE_AGENT_STORE``):
    the server the first rank-0 agent opened serves every later world too, still holding the dead world's keys
    (every rank's gloo address, NCCL's unique id), and torch tells worlds apart by ``TORCHELASTIC_RESTART_COUNT``,
    which is each agent's own count (pytorch/pytorch#135712): a restarted worker that comes up before its peer reads
    the dead world's address and fails to connect, and a replacement node's workers (count 0) and the survivors'
    (count 1) would not even look under one name. So rank 0 opens a store for this world and publishes
    ``host:port:nonce`` in the shared one; every other rank reads it until it reaches a live store that holds the
    same nonce (a dead world's entry points at a closed port, or at a store with another nonce).
    """
    global _world_store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    shared = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    if os.environ.get("RANK") == "0":
        nonce = uuid.uuid4().hex
        _world_store = open_store(address, timeout)
        _world_store.set("dynmo/nonce", nonce)
        shared.set(WORLD_STORE_KEY, f"{address}:{_world_store.port}:{nonce}")
        return _world_store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, store_port, nonce = shared.get(WORLD_STORE_KEY).decode().rsplit(":", 2)
        try:
            store = dist.TCPStore(host, int(store_port), is_master=False, timeout=timedelta(seconds=1))
            if store.get("dynmo/nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, dist.DistError):  # the dead world's store: closed, or someone else's now
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no live store of this world's rank 0 at {host}:{store_port} within {timeout}")
        time.sleep(0.2)
