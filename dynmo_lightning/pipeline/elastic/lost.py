"""Recovery without a restart (``strategy.on_peer_lost="recover"``): the survivors of a lost process go on.

With ``D >= 2`` replicas, a process's death leaves every replica it was not part of intact: those replicas hold every
layer with all its state (whole under ``data_parallel="ddp"`` or ``"replicate"``; under ``"fsdp"`` their shards and
the copies they keep of their replica peers' shards, :mod:`~dynmo_lightning.pipeline.elastic.mirror`). The survivors

1. notice (a call fails on the lost peer, or the heartbeats fall silent) and **abandon** the broken world's groups,
   so that no survivor keeps waiting on another (:func:`~dynmo_lightning.pipeline.topology.abandon.abandon_groups`);
2. **agree** on who was lost through the job manager's store (torchrun's agent store, or the launching process's),
   which outlives every worker: the first survivor to write the lost set decides it (``compare_set``);
3. **re-form** the world among the intact replicas' processes (:func:`plan_survivors`); the broken replicas' other
   processes end (their stage is incomplete); the intact replicas **take over the lost replicas' data shards** (whole
   shards, to the replicas with the fewest; each replica's loss weighted by its share, :meth:`Survivors.weight`), so
   that every step still trains on the same global batch: the math after the failure equals the uninterrupted run,
   after any number of losses while one replica is intact;
4. **re-run the interrupted step** from its beginning: no survivor applied it, because an optimizer step is applied
   only once every process has finished the step's communication (:meth:`InPlace.commit`, a two-phase commit
   through the same store), or, under FSDP2, every survivor went back to its own copy of the state before it.

What it needs is checked when the strategy is made (:func:`check_on_peer_lost`) and at set-up
(:func:`check_job_store`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from dynmo_lightning.core.composition import Composition, refuse
from dynmo_lightning.pipeline.elastic.mirror import ShardMirror
from dynmo_lightning.pipeline.topology.abandon import abandon_groups, listening_ports
from dynmo_lightning.pipeline.topology.heartbeats import PeerLostError
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout

#: What a job does when a process is lost: end (every process exits naming it) or go on with the survivors.
ON_PEER_LOST = ("stop", "recover")


def job_store_address() -> tuple[str, int] | None:
    """The job manager's store (torchrun's agent store, or :func:`~dynmo_lightning.launch.start_ranks`'s), if any."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])


def check_on_peer_lost(
    on_peer_lost: str, data_parallel: str, data_parallel_size: int, tensor_parallel_size: int
) -> None:
    """Refuse ``on_peer_lost`` settings the job cannot honour (at construction, naming the setting)."""
    if on_peer_lost not in ON_PEER_LOST:
        raise ValueError(f"strategy.on_peer_lost={on_peer_lost!r} is not one of {list(ON_PEER_LOST)}")
    refuse(Composition(data_parallel, data_parallel_size, tensor_parallel_size, on_peer_lost=on_peer_lost))


def check_job_store() -> None:
    """Refuse ``on_peer_lost="recover"`` in a job whose store lives in a worker (at set-up)."""
    if job_store_address() is None:
        raise ValueError(
            "strategy.on_peer_lost='recover' needs a store that outlives every worker, where the survivors meet: "
            "start the job with torchrun (its agent's store) or dynmo_lightning.launch.start_ranks; Lightning's own "
            "launcher hosts the store in rank 0"
        )


@dataclasses.dataclass(frozen=True)
class Survivors:
    """The world after a loss, as every survivor derives it from the agreed lost ranks.

    Attributes:
        lost: the lost global ranks (of the broken world).
        members: the new world's processes (old global ranks, in new-rank order): the intact replicas'.
        layout: the new world's layout (the intact replicas, renumbered; each keeps its data shard).
        shards: per new replica, every data shard it trains on: its own first, then those it took over from lost
            replicas (now or in an earlier recovery).
    """

    lost: list[int]
    members: list[int]
    layout: ReplicaLayout
    shards: list[list[int]]

    def weight(self, replica: int) -> float:
        """The factor on replica ``replica``'s loss that keeps the replicas' gradient average the job's mean.

        A replica training on ``k`` of the ``N`` shards averages over its ``k`` batches, and the average over the
        ``D'`` replicas weighs each of them as one: its loss counts ``k D' / N`` times.
        """
        total = sum(len(s) for s in self.shards)
        return len(self.shards[replica]) * len(self.shards) / total


def plan_survivors(
    layout: ReplicaLayout, lost: list[int], empty: Sequence[int] = (), shards: Sequence[Sequence[int]] | None = None
) -> Survivors:
    """Who goes on after ``lost`` died, and which data each intact replica trains on from now.

    ``empty``: pipeline ranks that hold no layer any more (a consolidation committed its layer moves before the
    loss): the intact replicas' processes there leave, as the consolidation meant them to. ``shards``: per replica,
    the data shards it trains on (``None``: its own only). A broken replica's shards go, one at a time, to the intact
    replica that trains on the fewest (the first such), so that no shard is lost and none is trained on twice.

    Raises:
        PeerLostError: no replica is intact.
    """
    if any(n != 1 for _, n in layout.parts):
        raise PeerLostError("recovery without restart does not cover replicas that split their shard's batches")
    intact, broken = _intact_replicas(layout, set(lost))
    if not intact:
        raise PeerLostError(f"rank {lost} lost a process in every replica: no replica holds every layer any more")
    held = [list(s) for s in shards] if shards is not None else [[shard] for shard, _ in layout.shards]
    kept = _share_out(held, intact, broken)
    new = _kept_layout(layout, intact, empty)
    return Survivors(sorted(lost), new.order, new.renumbered(), kept)


def _share_out(held: list[list[int]], intact: list[int], broken: list[int]) -> list[list[int]]:
    """The intact replicas' shards, the broken replicas' given one at a time to the one with the fewest."""
    kept = {d: list(held[d]) for d in intact}
    for shard in (s for d in broken for s in held[d]):
        min(kept.values(), key=len).append(shard)
    return [kept[d] for d in intact]


def _kept_layout(layout: ReplicaLayout, intact: list[int], empty: Sequence[int]) -> ReplicaLayout:
    """The intact replicas (each reading its own shard), without the pipeline ranks in ``empty``; old ranks."""
    t = layout.tp_size
    rows = [[rank for p, rank in enumerate(layout.replicas[d * t + j]) if p not in empty] for d in intact
            for j in range(t)]  # fmt: skip
    return ReplicaLayout(rows, [layout.shards[d] for d in intact], [(0, 1)] * len(intact), t)


def _intact_replicas(layout: ReplicaLayout, lost: set[int]) -> tuple[list[int], list[int]]:
    """The replicas none of whose processes was lost, and the others."""
    t = layout.tp_size
    hit = {d for d in range(layout.dp_size) for j in range(t) if lost & set(layout.replicas[d * t + j])}
    return [d for d in range(layout.dp_size) if d not in hit], sorted(hit)


class InPlace:
    """Where the survivors of a loss meet and agree: the job manager's store, under a prefix of this job's own.

    Args:
        timeout: of waits on the store.
        mirror: the copies of the replica peers' shards that make a lost FSDP2 shard whole again (idle where replicas
            hold their stages whole).
    """

    def __init__(self, timeout: timedelta, mirror: ShardMirror) -> None:
        self.timeout = timeout
        self.mirror = mirror
        self.store: dist.Store | None = None
        self.port = 0
        self.prefix = ""
        #: The world in force, counted from the job's first (each world's keys are its own: heartbeats, votes).
        self.world = 0
        #: Ports the job's processes listened on when the world started (their connections are shut on a loss).
        self.job_ports: set[int] = set()
        #: Ports of stores kept for the whole job (their connections outlive a world: the control store released
        #: processes wait on), besides the job manager's.
        self.keep: set[int] = set()
        #: Set when this process learns of a loss (the watchdog thread), read where it waits on the store.
        self.lost_event = threading.Event()
        #: The lost ranks this process last learnt of.
        self.last_lost: list[int] = []
        #: Recoveries made: ``{"step", "lost", "members", "ranks_lost", "seconds"}`` (``lost`` and ``members`` as
        #: start-up ranks, the processes' stable ids; ``ranks_lost`` as ranks of the world that lost them).
        self.recoveries: list[dict] = []
        #: Per replica of the world in force, the data shards it trains on (``None``: each its own only).
        self.shards: list[list[int]] | None = None

    def start(self, broadcast: Callable[[object], object]) -> None:
        """Enter a new world: learn its number and the job's listening ports (collective).

        Every world calls it: the first (which connects to the job manager's store), and each one a recovery, a
        shrink or a grow starts.
        """
        if self.store is None:
            address = job_store_address()
            assert address is not None, "check_job_store refuses a job without the job manager's store"
            self.port = address[1]
            self.store = dist.TCPStore(address[0], address[1], is_master=False, timeout=self.timeout)
            self.prefix = f"dynmo/in_place/{broadcast(uuid.uuid4().hex)}"
        else:  # rank 0's count: a process called back by a grow missed the worlds it was not in
            self.world = int(broadcast(self.world + 1))  # type: ignore[call-overload]
        gathered: list[set[int]] = [set()] * dist.get_world_size()
        dist.all_gather_object(gathered, listening_ports())
        self.job_ports = set().union(*gathered)
        self.lost_event.clear()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{self.world}/{name}"

    def heartbeat_store(self) -> dist.Store:
        """This world's heartbeats' store (keys of its own, so a dead world's beats are never read)."""
        assert self.store is not None
        return dist.PrefixStore(self._key("heartbeats/"), self.store)

    def on_lost(self, lost: list[int]) -> None:
        """A peer was lost (watchdog thread, or the call that failed): every wait of this process fails now."""
        self.last_lost = list(lost)
        self.lost_event.set()
        abandon_groups(self.job_ports, keep=[self.port, *self.keep])

    def agree(self, lost: list[int]) -> list[int]:
        """The lost ranks, as every survivor takes them: the first survivor's view, written once."""
        assert self.store is not None
        decided = self.store.compare_set(self._key("lost"), "", ",".join(map(str, sorted(lost))))
        return [int(r) for r in decided.decode().split(",") if r]

    def commit(self, step: int, world_size: int, vote: str = "commit") -> None:
        """Vote ``vote`` for step ``step`` and wait until every process voted.

        ``"commit"``: the step's communication is all done (the optimizer may apply it); ``"held"``: every process
        holds its predecessor's new shards (``pipeline/elastic/mirror.py``).

        Raises:
            PeerLostError: a process was lost before every vote was in; nobody acts on the vote.
        """
        assert self.store is not None
        votes, done = self._key(f"{vote}/{step}"), self._key(f"{vote}-done/{step}")
        if self.store.add(votes, 1) == world_size:
            self.store.set(done, "1")
            if step > 0:  # every process voted for this step, so all are past the previous one: its keys go
                for key in (f"{vote}/{step - 1}", f"{vote}-done/{step - 1}"):
                    self.store.delete_key(self._key(key))
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            # every vote may be in although a peer was lost since: then the others act on it, and so must this one
            if self.lost_event.is_set() and not self.store.check([done]):
                raise PeerLostError(f"rank {self.last_lost} was lost before step {step} was {vote}", self.last_lost)
            try:
                self.store.wait([done], timedelta(milliseconds=100))
                return
            except Exception:  # not yet
                continue
        raise PeerLostError(f"step {step} was not {vote} within {self.timeout}")

    def rejoin(self, rank: int, world_size: int, backend: str, device_kwargs: dict) -> None:
        """Start the survivors' default process group (collective over them: all were in this world)."""
        assert self.store is not None
        store = dist.PrefixStore(self._key("successor/"), self.store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout,
                                **device_kwargs)  # fmt: skip
