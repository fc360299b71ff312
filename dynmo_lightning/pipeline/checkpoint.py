"""Partition-independent checkpoint pieces: optimizer state keyed by parameter name, merged across stages.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in the optimizer, which differs between
stages and between partitions. DynMo stores optimizer state by the unsplit model's parameter names instead, so a
checkpoint written with P stages loads with any other P (and each stage picks out its own parameters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer

#: Marks optimizer state written in the named format.
NAMED_FORMAT = "dynmo-named-v1"


def _flat_params(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer's state with parameters identified by name.

    Args:
        optimizer: a (local) optimizer.
        names: ``id(param) -> name`` for every parameter the optimizer holds.

    Returns:
        ``{"format", "state": {name: per-param state}, "param_groups": [{hyper-parameters, "params": [names]}]}``.

    """
    sd = optimizer.state_dict()
    flat = _flat_params(optimizer)
    state = {names[id(p)]: sd["state"][i] for i, p in enumerate(flat) if i in sd["state"]}
    groups = []
    for group, sd_group in zip(optimizer.param_groups, sd["param_groups"], strict=True):
        hyper = {k: v for k, v in sd_group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    return {"format": NAMED_FORMAT, "state": state, "param_groups": groups}


def merge_named_optimizer_states(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Union of the named optimizer states of all stages (group hyper-parameters taken from the first stage).

    Raises:
        ValueError: the stages' optimizers do not have the same number of parameter groups.

    """
    n_groups = {len(p["param_groups"]) for p in parts}
    if len(n_groups) != 1:
        raise ValueError(
            f"pipeline stages built optimizers with different numbers of parameter groups ({sorted(n_groups)}); "
            "configure_optimizers must create the same groups on every stage (keep groups even when empty)"
        )
    state: dict[str, Any] = {}
    groups = [{**g, "params": []} for g in parts[0]["param_groups"]]
    for part in parts:
        state.update(part["state"])
        for merged, group in zip(groups, part["param_groups"], strict=True):
            merged["params"].extend(group["params"])
    return {"format": NAMED_FORMAT, "state": state, "param_groups": groups}


def local_optimizer_state(named: Mapping[str, Any], optimizer: Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """Convert a (merged) named optimizer state into ``optimizer.load_state_dict`` form for the local parameters.

    Raises:
        ValueError: the checkpoint was not written in the named format or its groups do not match the optimizer.

    """
    if named.get("format") != NAMED_FORMAT:
        raise ValueError(
            "The checkpoint's optimizer state was not written by DynMoStrategy (it is numbered by position, which "
            "depends on how the model was split). Resume it with the strategy that wrote it, or load only the "
            "weights (e.g. `model.load_state_dict(torch.load(path)['state_dict'])`) and start a new optimizer."
        )
    if len(named["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint optimizer has {len(named['param_groups'])} parameter groups, this stage's optimizer has "
            f"{len(optimizer.param_groups)}; configure_optimizers must build the same groups as when it was saved"
        )
    flat = _flat_params(optimizer)
    position = {id(p): i for i, p in enumerate(flat)}
    state = {position[id(p)]: named["state"][names[id(p)]] for p in flat if names[id(p)] in named["state"]}
    groups = []
    for group, saved in zip(optimizer.param_groups, named["param_groups"], strict=True):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": [position[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}
