"""The parts of recovery without restart, each on its own: who survives and which data it takes over, the agreement
and the commit through the job's store, the taken shards' batches, the settings' refusals, the watchdog that recovers
instead of ending the process, the committing optimizer, and abandoning a world (real processes, gloo)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dynmo_lightning.pipeline.elastic.lost import InPlace, check_job_store, plan_survivors
from dynmo_lightning.pipeline.elastic.mirror import ShardMirror
from dynmo_lightning.pipeline.elastic.survivors import open_store
from dynmo_lightning.pipeline.topology.data import TakenShards
from dynmo_lightning.pipeline.topology.heartbeats import PeerLostError, Watchdog, is_distributed_failure
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout
from dynmo_lightning.strategy.precision import PipelinePrecision


# --- who survives ---------------------------------------------------------------------------------------------------
def test_the_intact_replica_goes_on_and_takes_over_the_lost_replicas_shard():
    layout = ReplicaLayout.even(4, 2)  # replicas [0, 1] and [2, 3]
    lost_last = plan_survivors(layout, [3])
    assert lost_last.members == [0, 1] and lost_last.layout.replicas == [[0, 1]]
    assert lost_last.layout.shards == [(0, 2)] and lost_last.shards == [[0, 1]]
    assert lost_last.weight(0) == 1.0
    lost_first = plan_survivors(layout, [0])
    assert lost_first.members == [2, 3] and lost_first.layout.replicas == [[0, 1]]
    assert lost_first.layout.shards == [(1, 2)] and lost_first.shards == [[1, 0]]
    packed = plan_survivors(layout, [3], empty=[1])  # a consolidation onto pipeline rank 0 had committed
    assert packed.members == [0] and packed.layout.replicas == [[0]]


def test_uneven_shares_are_weighted_and_a_later_loss_passes_on_what_was_taken_over():
    layout = ReplicaLayout.even(3, 3)  # three replicas of one stage
    first = plan_survivors(layout, [2])
    assert first.shards == [[0, 2], [1]]
    assert [first.weight(r) for r in (0, 1)] == [4 / 3, 2 / 3]  # (2 + 1) shards' mean = (4/3 L0 + 2/3 L1) / 2
    second = plan_survivors(first.layout, [0], shards=first.shards)  # the replica that had taken shard 2 is lost
    assert second.members == [1] and second.shards == [[1, 0, 2]] and second.weight(0) == 1.0


def test_a_loss_in_every_replica_is_refused():
    with pytest.raises(PeerLostError, match="every replica"):
        plan_survivors(ReplicaLayout.even(4, 2), [1, 2])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(2, 6), st.data())
def test_every_shard_is_trained_on_exactly_once_and_weighted_to_the_mean(pp, dp, data):
    layout = ReplicaLayout.even(pp * dp, dp)
    lost = data.draw(st.sets(st.integers(0, pp * dp - 1), min_size=1, max_size=pp * dp - 1))
    broken = {layout.dp_rank(r) for r in lost}
    if len(broken) == dp:
        with pytest.raises(PeerLostError):
            plan_survivors(layout, sorted(lost))
        return
    plan = plan_survivors(layout, sorted(lost))
    assert not set(plan.members) & lost
    assert [s[0] for s in plan.shards] == [shard for shard, _ in plan.layout.shards]  # its own first
    assert sorted(s for shards in plan.shards for s in shards) == list(range(dp))  # nothing lost, nothing twice
    # the replicas' average of their weighted means is the mean over every shard
    means = {s: float(s + 1) for s in range(dp)}
    replica_means = [sum(means[s] for s in shards) / len(shards) for shards in plan.shards]
    average = sum(plan.weight(r) * m for r, m in enumerate(replica_means)) / len(plan.shards)
    assert average == pytest.approx(sum(means.values()) / dp)


# --- the store: agreement and commit ----------------------------------------------------------------------------------
def _in_place(store: dist.TCPStore) -> InPlace:
    in_place = InPlace(timedelta(seconds=20), ShardMirror(torch.device("cpu")))
    in_place.store, in_place.port, in_place.prefix = store, store.port, "test"
    return in_place


def test_the_first_survivor_to_write_the_lost_ranks_decides_them():
    store = open_store("127.0.0.1", timedelta(seconds=20))
    a, b = _in_place(store), _in_place(store)
    assert a.agree([3]) == [3]
    assert b.agree([2, 3]) == [3]  # a later, different view yields


def test_a_step_is_committed_only_when_every_process_voted():
    store = open_store("127.0.0.1", timedelta(seconds=20))
    voters = [_in_place(store) for _ in range(3)]
    outcome: dict[int, str] = {}

    def vote(i: int) -> None:
        try:
            voters[i].commit(5, 3)
            outcome[i] = "applied"
        except PeerLostError as e:
            outcome[i] = f"lost {e.lost}"

    threads = [threading.Thread(target=vote, args=(i,)) for i in (0, 1)]  # process 2 died before it voted
    for t in threads:
        t.start()
    for v in voters[:2]:
        v.last_lost = [2]
        v.lost_event.set()  # what the watchdog does when it finds process 2 silent
    for t in threads:
        t.join(timeout=30)
    assert outcome == {0: "lost [2]", 1: "lost [2]"}  # nobody applies the step

    later = [_in_place(store) for _ in range(3)]
    for v in later:
        v.world = 1  # the survivors' world votes under keys of its own
    threads = [threading.Thread(target=later[i].commit, args=(6, 3)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    later[0].commit(7, 1)  # a world of one: its own vote commits; step 6's keys go
    assert not store.check([later[0]._key("commit/6")])


def test_a_process_that_learns_of_a_loss_after_every_vote_was_in_acts_on_the_vote():
    """The others applied the step (every vote was in before the peer was lost): so must this one, or they part."""
    store = open_store("127.0.0.1", timedelta(seconds=20))
    late = _in_place(store)
    store.add(late._key("held/4"), 1)  # two processes voted, the third (which then died) too:
    store.set(late._key("held-done/4"), "1")  # every vote was in
    late.last_lost = [2]
    late.lost_event.set()
    late.commit(4, 3, "held")  # returns: no PeerLostError


# --- the taken shards ------------------------------------------------------------------------------------------------
def test_a_taken_shard_delivers_the_batches_its_lost_replica_would_have_read():
    data = TensorDataset(torch.arange(40.0).unsqueeze(1))
    own = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, 2, 0, shuffle=True, seed=7))
    lost = DistributedSampler(data, 2, 1, shuffle=True, seed=7)
    taken = TakenShards(own, [1])
    for epoch, start in ((0, 2), (1, 0)):  # taken over mid-epoch; then the next epoch from its start
        lost.set_epoch(epoch)
        expected = list(DataLoader(data, batch_size=3, sampler=lost))
        for i in range(start, len(expected)):
            (got,) = taken.batches(epoch, i)
            assert torch.equal(got[0], expected[i][0])


def test_taking_over_data_needs_a_sharded_loader():
    with pytest.raises(ValueError, match="DistributedSampler"):
        TakenShards(DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2), [1])


# --- settings ---------------------------------------------------------------------------------------------------------
def test_on_peer_lost_settings_are_refused_when_the_strategy_is_made(monkeypatch):
    from dynmo_lightning import DynMoStrategy

    with pytest.raises(ValueError, match="on_peer_lost='later' is not one of"):
        DynMoStrategy(on_peer_lost="later")
    with pytest.raises(ValueError, match="data_parallel_size >= 2"):
        DynMoStrategy(on_peer_lost="recover")
    with pytest.raises(ValueError, match="no tensor parallelism"):
        DynMoStrategy(on_peer_lost="recover", data_parallel_size=2, data_parallel="fsdp", tensor_parallel_size=2)
    DynMoStrategy(on_peer_lost="recover", data_parallel_size=2, data_parallel="replicate")
    DynMoStrategy(on_peer_lost="recover", data_parallel_size=2, data_parallel="fsdp")  # shards' copies on the peers
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        check_job_store()  # at set-up: Lightning's own launcher keeps the store in rank 0
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_job_store()


# --- noticing ---------------------------------------------------------------------------------------------------------
def test_a_failure_raised_from_a_lost_peers_error_counts_as_one():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        except RuntimeError as e:
            raise RuntimeError("Failed to run stage backward") from e
    except RuntimeError as wrapped:
        assert is_distributed_failure(wrapped)
    assert not is_distributed_failure(ValueError("a bug of this process"))


def test_the_watchdog_hands_a_silent_peer_to_recovery_instead_of_ending_the_process():
    store = open_store("127.0.0.1", timedelta(seconds=20))
    found: list[list[int]] = []
    done = threading.Event()

    def on_lost(lost: list[int]) -> None:
        found.append(lost)
        done.set()

    kwargs = {"world_size": 2, "interval": 0.1, "stale_after": 0.5, "store": store}
    alive = Watchdog("127.0.0.1", store.port, rank=0, on_lost=on_lost, **kwargs)
    silent = Watchdog("127.0.0.1", store.port, rank=1, **kwargs)
    silent.stop()  # rank 1 stops beating
    alive.current = "training step 3 (pipeline schedule)"
    assert done.wait(timeout=30)
    alive.stop()
    assert found == [[1]]  # once, and this process is still here


# --- the commit point -------------------------------------------------------------------------------------------------
def test_an_optimizer_step_applies_only_after_its_closure_was_committed():
    from lightning.pytorch.plugins.precision import Precision

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    events: list[str] = []

    def closure() -> torch.Tensor:
        events.append("closure")
        param.grad = torch.ones(2)
        return torch.zeros(())

    def run_closure(inner):
        result = inner()
        events.append(f"committed with {param.tolist()}")  # not applied yet
        return result

    plugin = PipelinePrecision(Precision())
    plugin.run_closure = run_closure
    model = type("M", (), {"trainer": None})()
    plugin.inner._wrap_closure = lambda model, optimizer, closure: closure()  # no Lightning hooks in a unit test
    plugin.optimizer_step(optimizer, model, closure)
    assert events == ["closure", "committed with [1.0, 1.0]"]
    assert param.tolist() == [0.0, 0.0]


def _three_processes(script: str) -> tuple[list[int], list[str]]:
    """Run ``script`` as ranks 0, 1, 2 (argv: rank, the port of a store this process hosts); exit codes, outputs."""
    store = open_store("127.0.0.1", timedelta(seconds=60))
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(store.port)], stdout=subprocess.PIPE, text=True)
        for r in range(3)
    ]
    out = [p.communicate(timeout=80)[0] for p in procs]
    return [p.returncode for p in procs], out


# --- the copies of FSDP2's shards (real processes) -------------------------------------------------------------------
_MIRROR = textwrap.dedent(
    """
    import sys, datetime
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from dynmo_lightning.pipeline.elastic.mirror import ShardMirror
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    T = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=T)
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",))
    whole = [torch.arange(14.0).reshape(7, 2), torch.arange(5.0, dtype=torch.float64)]  # uneven: 3 + 3 + 1 rows
    weight, moment = (distribute_tensor(w, mesh, [Shard(0)]) for w in whole)
    count = torch.tensor(3.0)  # held alike by every replica (a step count)
    state = [weight, moment, count]
    mirror = ShardMirror(torch.device("cpu"))
    mirror.exchange(state, mesh.get_group(), world=0)
    mirror.promote()
    before = [t.to_local().clone() for t in (weight, moment)]
    copy = mirror.copies(state, 0)
    (place,) = copy
    assert place == (rank - 1) % 3
    for t, w in zip((weight, moment), whole):
        assert torch.equal(copy[place](t), w.chunk(3)[place]), (rank, place)  # the predecessor's part, exactly
    with torch.no_grad():  # a step applied: then the exchange fails before every process holds the new copies
        weight.to_local().add_(1.0)
        count.add_(1.0)
    mirror.exchange(state, mesh.get_group(), world=0)
    mirror.restore(state, 0)  # not promoted: back to the state of the last complete exchange
    assert torch.equal(weight.to_local(), before[0]) and count.item() == 3.0
    assert torch.equal(copy[place](weight), whole[0].chunk(3)[place])
    assert mirror.copies([weight, moment], 0) == {} and mirror.copies(state, 1) == {}  # other tensors, other world
    print("ok", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(90)
def test_each_process_holds_its_predecessors_shards_and_goes_back_to_its_own():
    codes, out = _three_processes(_MIRROR)
    assert codes == [0, 0, 0] and all("ok" in o for o in out), out


# --- abandoning a world (real processes) ------------------------------------------------------------------------------
_ABANDON = textwrap.dedent(
    """
    import os, sys, time, threading, datetime
    import torch, torch.distributed as dist
    from dynmo_lightning.pipeline.topology.abandon import abandon_groups, listening_ports
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    T = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    dist.init_process_group("gloo", store=dist.PrefixStore("w0", store), rank=rank, world_size=3, timeout=T)
    pair = dist.new_group([0, 2])  # the group a survivor waits in does not hold the lost process
    ports = [None] * 3
    dist.all_gather_object(ports, listening_ports())
    if rank == 1:
        os._exit(9)
    t = torch.zeros(1)
    if rank == 0:
        time.sleep(1)
        abandon_groups(set().union(*ports), keep=[port])  # rank 0 recovers: rank 2 must not wait for it
    else:
        try:
            dist.recv(t, src=0, group=pair)
            print("received", flush=True)
        except RuntimeError:
            print("abandoned", flush=True)
    dist.destroy_process_group()  # `pair` stays referenced, as a strategy's groups are: its sockets stay open
    dist.init_process_group("gloo", store=dist.PrefixStore("w1", store), rank=rank // 2, world_size=2, timeout=T)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    print("new world", int(t.item()), flush=True)
    """
)


@pytest.mark.timeout(90)
def test_abandoning_ends_a_survivors_wait_on_another_survivor():
    codes, out = _three_processes(_ABANDON)
    assert codes[1] == 9
    assert "abandoned" in out[2] and "received" not in out[2]
    assert "new world 4" in out[0] and "new world 4" in out[2]  # the survivors meet again (1 + 3)
