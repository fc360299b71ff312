"""What dynamics callbacks use on every process: their layers, telling the strategy, agreeing with the others."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dynmo_lightning.core.context import on_host
from dynmo_lightning.core.control import LayerEvents, pipeline_control


def local_layers(module: Any) -> list[tuple[int, nn.Module]]:
    """``(index, layer)`` of the pipeline layers held by this process (all of them without a pipeline strategy).

    Layers of other pipeline stages are placeholders marked ``pipeline_remote``; dynamics callbacks change only the
    layers they hold, and agree with the other processes through collectives.
    """
    return [
        (i, layer) for i, layer in enumerate(module.pipeline_layers()) if not getattr(layer, "pipeline_remote", False)
    ]


def layers_changed(trainer: Any, layers: Iterable[int] | None = None) -> None:
    """Tell the strategy that layers changed their cost or which parameters train (call on every process).

    A pipeline strategy rebuilds its stages before the next step (stage boundaries may stop carrying gradients) and
    tells the balancer, which restarts the changed layers' cost history; other strategies ignore it.

    Args:
        trainer: the Trainer.
        layers: indices of the layers that changed (``None``: any may have).
    """
    control = pipeline_control(trainer, LayerEvents)
    if control is not None:
        control.on_layers_changed(None if layers is None else sorted(set(layers)))


def all_gather(obj: Any, trainer: Any = None, *, replicas: bool = False) -> list[Any]:
    """Every process's ``obj`` (just ``[obj]`` without torch.distributed): how dynamics agree on global decisions.

    Under data parallelism, the pipeline's processes of the first replica only, by pipeline rank: replicas hold the
    same layers, so a decision made from one replica's parts is the same on every process of the job (and the same
    as without replicas, where what is gathered is the same everywhere).

    Args:
        obj: this process's part (picklable).
        trainer: the Trainer (a pipeline strategy says how processes form replicas); ``None``: every process's part.
        replicas: return ``[[parts of replica 0], [parts of replica 1], ...]`` instead (for statistics of data that
            differ between replicas).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [[obj]] if replicas else [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    control = pipeline_control(trainer, LayerEvents) if trainer is not None else None
    if control is not None:  # over the strategy's CPU group: pickles never staged on a GPU
        with on_host():
            torch.distributed.all_gather_object(out, obj, group=control.host_group)
    else:
        torch.distributed.all_gather_object(out, obj)
    layout = (control.replica_ranks if control is not None else None) or [list(range(len(out)))]
    by_replica = [[out[r] for r in ranks] for ranks in layout]
    return by_replica if replicas else by_replica[0]
