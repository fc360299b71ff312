"""Fail fast when a process of the job dies: heartbeats, and errors that name the lost rank and the phase.

gloo reports a dead peer as "connection closed" (on the ranks that talk to it directly) and NCCL may just wait until
its timeout, so neither says *which* process was lost nor what the job was doing. Every process therefore writes a
heartbeat into a small key-value store hosted by rank 0, from a daemon thread, every ``interval`` seconds.

* When a distributed call fails, the process announces that it is failing (so that it is not blamed itself), waits
  until the heartbeats show which rank went silent, and raises :class:`PeerLostError` naming that rank, the phase
  (training step, validation, migration, checkpoint, consolidation) and the step.
* When a rank goes silent while this process is blocked (a collective that never returns), the watchdog thread
  reports the same message and ends the process with exit status 1 after ``stale_after`` seconds, well before the
  collective timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

log = logging.getLogger(__name__)


#: Store key naming the ranks found lost.
_LOST = "dynmo/lost"


class PeerLostError(RuntimeError):
    """A process of the job died (or stopped responding) while this one needed it.

    Args:
        message: what happened, naming the lost rank and the phase.
        lost: the lost global ranks, when known (a recovery without restart starts from them).
    """

    def __init__(self, message: str, lost: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost = list(lost or [])


class Watchdog:
    """Heartbeats of the job's processes, kept in a TCP store on rank 0.

    Args:
        address: the store's host (the job's main address).
        port: the store's port (chosen by rank 0 and shared beforehand).
        rank: this process's rank.
        world_size: processes in the job.
        interval: seconds between heartbeats.
        stale_after: a rank whose heartbeat is older than this is lost.
        store: the store itself, when this process (rank 0) already opened it, or one outside the job's processes
            (recovery without restart: the job manager's store, so that it outlives any of them).
        on_lost: called by the watchdog thread with the lost ranks instead of ending this process (recovery without
            restart: it makes this process's waiting calls fail, so that the main thread recovers).

    What the job is doing is named with :meth:`phase`; between phases (:attr:`current` is ``None``) a silent peer is
    not acted on here: whatever this process does next will fail on it, or the job is ending.
    """

    def __init__(
        self,
        address: str,
        port: int,
        *,
        rank: int,
        world_size: int,
        interval: float = 2.0,
        stale_after: float = 15.0,
        store: dist.Store | None = None,
        on_lost: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._on_lost = on_lost
        self._lock, self._acted = threading.Lock(), False
        self.interval, self.stale_after = interval, stale_after
        #: What the job is doing now (for messages); ``None`` between distributed phases.
        self.current: str | None = None
        timeout = timedelta(seconds=max(stale_after, 30.0))
        if store is None:
            store = dist.TCPStore(address, port, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
        self._store = store
        self._stop = threading.Event()
        #: Ranks some process found lost (published in the store, remembered here in case rank 0 then goes too).
        self.known_lost: list[int] = []
        self._beat()
        self._thread = threading.Thread(target=self._run, name="dynmo-watchdog", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._store.set(f"dynmo/heartbeat/{self.rank}", repr(time.time()))
        if self._store.check([_LOST]):
            self.known_lost = [int(r) for r in self._store.get(_LOST).decode().split(",") if r]

    def _publish(self, lost: list[int]) -> None:
        """Tell the others who was lost (before rank 0's store may vanish with rank 0)."""
        self.known_lost = lost
        with contextlib.suppress(Exception):  # the store's host may be the one lost
            self._store.set(_LOST, ",".join(map(str, lost)))

    def _ages(self) -> dict[int, float]:
        """Seconds since each rank's last heartbeat (a rank that never wrote one counts as just started)."""
        now, ages = time.time(), {}
        for r in range(self.world_size):
            key = f"dynmo/heartbeat/{r}"
            ages[r] = now - float(self._store.get(key)) if self._store.check([key]) else 0.0
        return ages

    def _failing(self) -> set[int]:
        return {r for r in range(self.world_size) if self._store.check([f"dynmo/failing/{r}"])}

    def lost(self, wait: float | None = None) -> list[int]:
        """Ranks whose heartbeat stopped, waiting up to ``wait`` seconds for one to show.

        Rank 0 when the store is gone: it lives in rank 0's process.
        """
        deadline = time.time() + (self.stale_after + 2 * self.interval if wait is None else wait)
        while True:
            try:
                failing = self._failing()
                stale = [r for r, age in self._ages().items() if age > self.stale_after and r not in failing]
            except Exception:
                # An unreachable store means its host, rank 0, is gone -- unless someone found the culprit first
                # and rank 0 stopped because of it.
                return self.known_lost or ([0] if self.rank != 0 else [])
            if stale or time.time() >= deadline:
                return stale
            time.sleep(self.interval)

    @contextlib.contextmanager
    def phase(self, name: str, step: Callable[[], int]) -> Iterator[None]:
        """Name what the job does while inside; turn a lost peer's error into one that names it and the phase.

        Args:
            name: the phase, e.g. ``"training step 3 (pipeline schedule)"``.
            step: returns the training step (for the message).
        """
        previous, self.current = self.current, name
        try:
            yield
        except PeerLostError:
            raise
        except Exception as e:
            # Once a loss is known, whatever failed failed because of it (the abandoned groups' calls).
            if is_distributed_failure(e) or self._acted:
                raise self.explain(e, step()) from e
            raise
        finally:
            self.current = previous

    def explain(self, error: BaseException, step: int) -> PeerLostError:
        """The error to raise instead of ``error`` (a failed distributed call): who was lost, when, doing what."""
        phase = self.current or "a collective"
        try:
            self._store.set(f"dynmo/failing/{self.rank}", phase)
        except Exception:
            pass
        lost = self.lost()
        if lost:
            self._publish(lost)
        who = f"rank {', '.join(map(str, lost))}" if lost else "another process"
        if self._on_lost is not None and lost:
            self._lost_once(lost)  # peers waiting on this process fail now too: every survivor comes to recover
        return PeerLostError(
            f"{who} of the job was lost during {phase} (step {step}); rank {self.rank} stops too. "
            f"Resume from the last checkpoint. Cause: {type(error).__name__}: {error}",
            lost,
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            phase = self.current
            try:
                self._beat()
                failing = self._failing()
                ages = self._ages()
            except Exception:  # the store is gone with its host, rank 0 (or with what it found)
                if self._stop.is_set():
                    return
                ages, failing = {r: float("inf") for r in (self.known_lost or [0])}, set()
            stale = [r for r, age in ages.items() if age > self.stale_after and r not in failing and r != self.rank]
            if stale and phase is not None and not self._stop.is_set() and self.rank not in failing:
                self._publish(stale)
                message = (
                    f"rank {', '.join(map(str, stale))} of the job stopped responding during {phase}; "
                    f"rank {self.rank} stops too. Resume from the last checkpoint."
                )
                if self._on_lost is not None:  # beats go on: the survivors must see each other while they meet
                    self._lost_once(stale)
                    continue
                log.error(message)
                print(f"[dynmo] {message}", file=sys.stderr, flush=True)
                # Give the others time to read who was lost before this process (maybe the store's host) ends.
                time.sleep(2 * self.interval)
                os._exit(1)  # a blocked collective cannot be interrupted from here: end the process

    def _lost_once(self, lost: list[int]) -> None:
        """Call ``on_lost`` once per world (from the watchdog thread or the failing call, whichever is first)."""
        with self._lock:
            if self._acted:
                return
            self._acted = True
        log.warning("rank %s of the job was lost during %s; recovering without a restart", lost, self.current)
        assert self._on_lost is not None
        self._on_lost(lost)

    def stop(self) -> None:
        """Stop beating (training ended normally, or this process was released).

        Waits briefly for the heartbeat thread, so that none is inside a store call when the process exits.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)


class Heartbeats:
    """This process's :class:`Watchdog` across the job's worlds: one per world, none between, and the phases named.

    A world's heartbeats end before the world does (a shrink's released processes fall silent on purpose) and the
    next world's start in it; outside a world, phases name nothing.

    Args:
        stale_after: seconds of silence after which a process counts as lost.
        step: returns the training step (for messages).
    """

    def __init__(self, stale_after: float, step: Callable[[], int]) -> None:
        self.stale_after, self._step = stale_after, step
        self.watchdog: Watchdog | None = None

    def start(
        self,
        environment: ClusterEnvironment,
        stores: list[dist.TCPStore | None],
        ports: list[int],
        *,
        outside: dist.Store | None = None,
        on_lost: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Start this process's heartbeats in the world of ``environment``.

        The last of its host stores serves them, or ``outside``: a store no process of the job hosts (recovery
        without restart), whose watchdog calls ``on_lost`` instead of ending the process.
        """
        store = outside if outside is not None else stores[-1]
        kwargs = {"interval": min(2.0, self.stale_after / 5), "stale_after": self.stale_after, "store": store}
        rank, size = environment.global_rank(), environment.world_size()
        self.watchdog = Watchdog(environment.main_address, ports[-1], rank=rank, world_size=size, on_lost=on_lost,
                                 **kwargs)  # fmt: skip

    def stop(self) -> None:
        """End this world's heartbeats (before the world ends, or at the end of training)."""
        if self.watchdog is not None:
            self.watchdog, watchdog = None, self.watchdog
            watchdog.stop()

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Name what the job does (for failure messages; a lost peer's error then names it and the phase)."""
        return contextlib.nullcontext() if self.watchdog is None else self.watchdog.phase(name, self._step)


def is_distributed_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from a peer's failure rather than from this process's own code.

    The errors it was raised from count too: torch's pipelining stages re-raise a failed receive as their own
    ``RuntimeError`` ("Failed to run stage backward"), the cause chained.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _names_a_peer(error):
            return True
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return False


def _names_a_peer(error: BaseException) -> bool:
    """Whether ``error`` itself reads as a failed distributed call."""
    text = f"{type(error).__name__}: {error}"
    markers = (
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "Connection closed",
        "Connection reset",
        "gloo",
        "NCCL",
        "Broken pipe",
        "timed out",
        "Timeout",
    )
    return isinstance(error, dist.DistError) or any(m in text for m in markers)
