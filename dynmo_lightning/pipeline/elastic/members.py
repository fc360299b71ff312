"""Who is in the job, where, and who waits to come back: the elastic side of shrinking and growing the world.

:class:`ElasticWorld` keeps, on every process, the node of every rank (gathered at start-up), a stable id per process
(its rank at start-up: ranks are renumbered by every restart of the world), the processes released with
``on_release="wait"`` (they may be re-admitted), and every release. It carries out the world's side of

- a **shrink** (``strategy.pipeline_control.shrink``): released processes tell the callbacks (``on_released``),
  finalize their loggers and end, or wait on rank 0's control store; survivors renumber and describe the release;
- a **grow** (``strategy.pipeline_control.grow``): rank 0 calls waiting processes back through the control store
  with the new world's order and the trainer's state at this step (loops, callbacks, schedulers); the survivors and the
  re-admitted processes start a new world together, and the layers move onto the new stages with all their state.

Re-admitted processes come back inside the same hook they left from (the balancer's ``on_train_batch_end``), so
after :func:`restore_trainer_state` they continue Lightning's loop in step with the others. They run middle stages
(the survivors keep the first and the last), which read only the shape of their batch; their data iterator is
still moved to the batch the others are at.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.loops.loop import _Loop
from lightning_utilities.core.apply_func import apply_to_collection

from dynmo_lightning.pipeline.elastic import release
from dynmo_lightning.pipeline.elastic import survivors as groups
from dynmo_lightning.pipeline.topology.pending import end_default_group
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout


def _call_key(origin: int) -> str:
    return f"dynmo/grow/{origin}"


class ElasticWorld:
    """The job's processes across restarts of the world (see the module docstring)."""

    def __init__(self) -> None:
        #: ``(node rank, node name)`` of every global rank now.
        self.hosts: list[tuple[int, str]] = []
        #: The start-up rank of every global rank now (a process's stable id).
        self.origins: list[int] = []
        #: This process's start-up rank.
        self.origin = 0
        #: ``(start-up rank, host)`` of processes released with ``on_release="wait"``, in the order they left.
        self.waiting: list[tuple[int, tuple[int, str]]] = []
        #: Every release (:class:`~dynmo_lightning.pipeline.elastic.release.ReleaseEvent` as a dict).
        self.releases: list[dict[str, Any]] = []
        self.control: dist.TCPStore | None = None  # rank 0: the store waiting processes listen on
        self.control_port: int | None = None

    def start(self, node_rank: int) -> None:
        """Learn every process's node (collective, once, in the first world)."""
        size = dist.get_world_size()
        hosts: list[Any] = [None] * size
        dist.all_gather_object(hosts, (node_rank, release.node_name()))
        self.hosts = [tuple(h) for h in hosts]
        self.origins = list(range(size))
        self.origin = dist.get_rank()

    def pipeline_nodes(self, layout: ReplicaLayout) -> list[Any] | None:
        """The node of every pipeline rank (with replicas, the tuple of their nodes); ``None`` before start-up."""
        if len(self.hosts) != sum(len(r) for r in layout.replicas):
            return None
        nodes = [tuple(self.hosts[g][0] for g in ranks) for ranks in zip(*layout.replicas, strict=True)]
        return [n[0] for n in nodes] if len(layout.replicas) == 1 else nodes

    def keep_control(self, store: dist.TCPStore | None, port: int) -> int:
        """The control store's port: the first one opened is kept for the whole job (waiting processes listen)."""
        if self.control_port is None:
            self.control, self.control_port = store, port
        return self.control_port

    def end(self) -> None:
        """Training ended: processes still waiting may exit (rank 0)."""
        if self.control is not None:
            self.control.set(groups.SHUTDOWN_KEY, "1")

    # --- shrink ------------------------------------------------------------------------------------------------------
    def leave(
        self, trainer: pl.Trainer, on_release: str, *, environment: ClusterEnvironment, device: torch.device, **_: Any
    ) -> dict[str, Any]:
        """This process is released: tell the callbacks, leave the world; exit, or wait to be called back.

        Returns:
            The call back of a grow (``on_release="wait"`` only; otherwise the process ends here with status 0).
        """
        module = trainer.lightning_module
        for callback in trainer.callbacks:
            hook = getattr(callback, "on_released", None)
            if callable(hook):
                hook(trainer, module)
        end_default_group()
        assert self.control_port is not None
        address = environment.main_address
        call = groups.release(address, self.control_port, on_release, device, key=_call_key(self.origin))
        if call is None:  # released for good (or training ended while it waited)
            for logger in trainer.loggers:
                logger.finalize("success")
            groups.end_process()
        return pickle.loads(call)

    def survive(
        self,
        order: list[int],
        stores: list[dist.TCPStore | None],
        ports: list[int],
        step: int,
        on_release: str,
        *,
        environment: ClusterEnvironment,
        backend: str,
        timeout: timedelta,
        device: torch.device,
    ) -> tuple[groups.ResizedEnvironment, groups.WorldView, release.ReleaseEvent]:
        """A survivor of a shrink to ``order`` (old global ranks): start the new world, renumber, describe it.

        Every survivor's environment then says ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``NODE_RANK``/``GROUP_RANK`` and ``MASTER_PORT`` of the new world.
        """
        world_before = len(self.hosts)
        me = dist.get_rank()
        end_default_group()
        resized, view = groups.rejoin(
            environment, order, me, stores, ports, nodes=[node for node, _ in self.hosts], backend=backend,
            timeout=timeout, device=device,
        )  # fmt: skip
        event = release.describe(step, order, self.hosts, world_before)
        if on_release == "wait":
            self.waiting += [(self.origins[g], self.hosts[g]) for g in event.released_ranks]
        self.hosts = [self.hosts[g] for g in order]
        self.origins = [self.origins[g] for g in order]
        self.releases.append(dataclasses.asdict(event))
        return resized, view, event

    def regroup(
        self, members: list[int], me: int, environment: ClusterEnvironment, main_port: int
    ) -> tuple[groups.ResizedEnvironment, groups.WorldView]:
        """The survivors ``members`` (old global ranks) of a loss are the world now (its process group is started).

        Every member's view then agrees, as after a shrink; the lost processes are forgotten (they do not wait).
        """
        view = groups.world_view(members, me, [node for node, _ in self.hosts], main_port)
        os.environ.update(view.environ())
        self.hosts = [self.hosts[g] for g in members]
        self.origins = [self.origins[g] for g in members]
        resized = groups.ResizedEnvironment(environment, view.world_size, view.rank, main_port, view.local_rank,
                                            view.node_rank)  # fmt: skip
        return resized, view

    # --- grow --------------------------------------------------------------------------------------------------------
    def call_plan(self, layers_per_stage: list[int], current: list[int], ports: list[int], step: int) -> dict[str, Any]:
        """The world of a grow to ``layers_per_stage``: waiting processes join as middle stages (all processes)."""
        admit = len(layers_per_stage) - len(current)
        if not 0 < admit <= len(self.waiting):
            raise ValueError(f"cannot grow by {admit} stages: {len(self.waiting)} released processes wait")
        if len(current) < 2:
            raise ValueError("a grow needs two kept ranks (they keep the first and the last stage)")
        joining = self.waiting[:admit]
        survivors = list(zip(self.origins, self.hosts, strict=True))
        order = [*survivors[:-1], *joining, survivors[-1]]
        return {
            "order": [o for o, _ in order],
            "hosts": [h for _, h in order],
            "ports": ports,
            "padded": [*current[:-1], *[0] * admit, current[-1]],
            "plan": list(layers_per_stage),
            "step": step,
            "waiting": self.waiting[admit:],
        }

    def call_back(self, plan: dict[str, Any], state: dict[str, Any]) -> None:
        """Rank 0: tell the waiting processes of ``plan`` to join, with the trainer's ``state``."""
        assert self.control is not None
        blob = pickle.dumps({**plan, "state": state})
        for origin in plan["order"]:
            if origin not in self.origins:
                self.control.set(_call_key(origin), blob)

    def join(
        self,
        plan: dict[str, Any],
        stores: Sequence[dist.TCPStore | None],
        *,
        environment: ClusterEnvironment,
        backend: str,
        timeout: timedelta,
        device: torch.device,
    ) -> tuple[groups.ResizedEnvironment, groups.WorldView]:
        """Start the grown world of ``plan`` (collective over it); every process's view agrees afterwards."""
        order = plan["order"]
        resized, view = groups.rejoin(
            environment, range(len(order)), order.index(self.origin), stores, plan["ports"],
            nodes=[h[0] for h in plan["hosts"]], backend=backend, timeout=timeout, device=device,
        )  # fmt: skip
        self.hosts = [tuple(h) for h in plan["hosts"]]
        self.origins = list(order)
        self.waiting = [(o, tuple(h)) for o, h in plan["waiting"]]
        return resized, view


# --- the trainer's state, handed to re-admitted processes -------------------------------------------------------------
def capture_trainer_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What a process needs to continue Lightning's loop at this step: loops, callbacks, LR schedulers.

    Tensors in it (a monitored ``ModelCheckpoint``'s ``best_model_score`` lives on the GPU) come to the CPU before it
    is pickled for the re-admitted processes: unpickled, a CUDA tensor would land on rank 0's device index, or fail
    where that index is not visible; loaded state is on the CPU anyway, as from a checkpoint.
    """
    state = {
        "fit_loop": trainer.fit_loop.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    return apply_to_collection(state, torch.Tensor, lambda t: t.detach().cpu())


def _not_restarting(loop: Any) -> None:
    """Clear the restart flags ``load_state_dict`` set on ``loop`` and every loop inside it."""
    loop._restarting = False
    if callable(getattr(loop, "reset_restart_stage", None)):
        loop.reset_restart_stage()
    for child in vars(loop).values():
        if isinstance(child, _Loop):
            _not_restarting(child)


def restore_trainer_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Continue from rank 0's ``state`` (a re-admitted process, inside the hook it left from)."""
    loop = trainer.fit_loop
    epoch, consumed = loop.epoch_progress.current.processed, loop.epoch_loop.batch_progress.current.ready
    loop.load_state_dict(state["fit_loop"])
    _not_restarting(loop)  # not a restart: the loops go on from inside this step
    for callback in trainer.callbacks:
        if callback.state_key in state["callbacks"]:
            callback.load_state_dict(state["callbacks"][callback.state_key])
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler_state)
    fetcher = loop._data_fetcher
    if fetcher is None:
        return
    if loop.epoch_progress.current.processed != epoch:  # the others are in a later epoch: its order, from the start
        for loader in loop._combined_loader.flattened if loop._combined_loader is not None else []:
            _set_sampler_epoch(loader, loop.epoch_progress.current.processed)
        iter(fetcher)
        consumed = 0
    for _ in range(loop.epoch_loop.batch_progress.current.ready - consumed):
        next(fetcher)
