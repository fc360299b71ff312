"""Sharded checkpoints: every stage writes its own layers with ``torch.distributed.checkpoint``; any width reads them.

A checkpoint is a directory (as Lightning's FSDP and ModelParallel strategies write theirs):

- the DCP shards (``__<rank>_0.distcp`` and ``.metadata``): ``model.<name>`` for every tensor of the unsplit model's
  state dict and ``optim.<i>.state.<param name>.<key>`` for optimizer ``i``'s state of every parameter, each written
  by the stage that holds it, in parallel (the first replica's stages; replicas are identical);
- ``meta.pt``: everything else, written once by pipeline rank 0: Lightning's loops, callbacks, LR schedulers, the
  optimizers' parameter groups (hyper-parameters and parameter names), the partitions and world (``dynmo``).

Names are the unsplit model's, so loading is resharding by name: each process asks DCP for its own layers' keys
only, whatever the pipeline width, replica count or partition that wrote them. Writing goes to a temporary directory
that replaces the previous checkpoint only once complete (an interrupted save leaves the last complete one, at the
path or, for an instant, at ``<path>.old``).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.optim import Optimizer

from dynmo_lightning.pipeline import safe_load
from dynmo_lightning.pipeline.checkpoint import (
    NAMED_FORMAT,
    check_keys,
    local_optimizer_state,
    merge_named_optimizer_states,
)
from dynmo_lightning.pipeline.layout import PipelineGroup

#: Checkpoint formats: ``"sharded"`` (a DCP directory, every stage writes its part), ``"single"`` (one file gathered
#: on rank 0), ``"auto"`` (sharded when the pipeline has more than one stage).
FORMATS = ("auto", "sharded", "single")

#: The file of a sharded checkpoint that holds everything but the tensors.
META = "meta.pt"

#: Key of the loaded metadata that says where the shards are (the strategy reads its stage's part from there).
SHARDS_KEY = "dynmo_shards"


def _directory(path: str | os.PathLike[str]) -> Path | None:
    """The complete sharded checkpoint at ``path`` (or at ``<path>.old``, where a swap was interrupted), if any."""
    for d in (Path(path), Path(os.fspath(path) + ".old")):
        if (d / META).is_file():
            return d
    return None


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded (directory) checkpoint."""
    return _directory(path) is not None


def _tensors(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors this stage writes: its model state and the per-parameter optimizer states (named format)."""
    optim = {str(i): {"state": dict(o["state"])} for i, o in enumerate(checkpoint.get("optimizer_states") or [])}
    return {"model": dict(checkpoint.get("state_dict", {})), "optim": optim}


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike[str], pipe: PipelineGroup) -> None:
    """Write ``checkpoint`` (this stage's part) as a sharded checkpoint at ``path`` (collective over ``pipe``).

    Args:
        checkpoint: Lightning's checkpoint dict on this stage: ``state_dict`` holds this stage's tensors,
            ``optimizer_states`` its named optimizer states; the rest is the same on every stage.
        path: the checkpoint directory.
        pipe: the pipeline whose stages write (the first replica's).
    """
    target = os.fspath(path)
    # One temporary directory for all stages, named by pipeline rank 0.
    tag = [uuid.uuid4().hex if pipe.rank == 0 else None]
    dist.broadcast_object_list(tag, src=pipe.global_rank(0), group=pipe.control)
    tmp = f"{target}.tmp-{tag[0]}"
    # DCP's own collectives exchange plans and metadata (host data): the control group carries them.
    dcp.save(_tensors(checkpoint), storage_writer=dcp.FileSystemWriter(tmp), process_group=pipe.control)
    # Parameter groups: hyper-parameters and the names of every stage's parameters (names only, no tensors).
    groups = [{"format": NAMED_FORMAT, "state": {}, "param_groups": o["param_groups"]} for o in
              checkpoint.get("optimizer_states") or []]  # fmt: skip
    parts: list[Any] | None = [None] * pipe.size if pipe.rank == 0 else None
    dist.gather_object(groups, parts, dst=pipe.global_rank(0), group=pipe.control)
    if parts is not None:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["optimizer_states"] = [merge_named_optimizer_states([p[i] for p in parts]) for i in range(len(groups))]
        torch.save(meta, os.path.join(tmp, META))
        _replace(tmp, target)
    dist.barrier(group=pipe.control)


def _replace(tmp: str, target: str) -> None:
    """Put the complete directory ``tmp`` at ``target``; the previous checkpoint stays complete until then."""
    old = f"{target}.old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(target):
        os.replace(target, old)
    elif os.path.exists(target):
        os.remove(target)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def load_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything of a sharded checkpoint but its tensors (on every process); marks where the shards are."""
    d = _directory(path)
    if d is None:
        raise FileNotFoundError(f"{os.fspath(path)} is not a sharded checkpoint (it has no {META})")
    meta = safe_load.load_file(d / META)
    if not isinstance(meta, dict):
        raise ValueError(f"{d / META} holds a {type(meta).__name__}, not a checkpoint's entries")
    meta[SHARDS_KEY] = os.fspath(d)
    meta["state_dict"] = {}  # each stage reads its own part: load_stage_model
    return meta


def load_stage_model(module: nn.Module, shards: str, global_keys: set[str], strict: bool) -> None:
    """Read this stage's tensors of ``module`` from ``shards`` into it, in place (collective over the world).

    Raises:
        RuntimeError: the checkpoint does not match the model (keys missing on either side, other shapes).
    """
    metadata = safe_load.read_dcp_metadata(shards).state_dict_metadata
    saved = {k.removeprefix("model."): m for k, m in metadata.items() if k.startswith("model.")}
    local = module.state_dict()
    if strict:
        check_keys(local.keys(), saved.keys(), global_keys)
    # Read into tensors of the saved shapes: a pruned layer takes its shapes from the checkpoint when it loads.
    wanted = {k: _empty_like(saved[k]) for k in local if k in saved}
    _load_shards({"model": wanted}, shards)
    module.load_state_dict(wanted, strict=False)


def _empty_like(meta: Any) -> Any:
    """An empty tensor of a saved tensor's shape and dtype (``None`` for a saved object: DCP replaces it)."""
    if isinstance(meta, TensorStorageMetadata):
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    assert isinstance(meta, BytesStorageMetadata)
    return None


def load_stage_optimizer(
    optimizer: Optimizer, index: int, named_groups: Mapping[str, Any], shards: str, names: Mapping[int, str]
) -> dict[str, Any]:
    """This stage's part of optimizer ``index``'s state, in ``optimizer.load_state_dict`` form (collective).

    The state's shapes come from the checkpoint's metadata, so it loads into an optimizer that has not stepped yet.
    """
    metadata = safe_load.read_dcp_metadata(shards).state_dict_metadata
    local = {names[id(p)] for group in optimizer.param_groups for p in group["params"]}
    template = _optimizer_state(metadata, index, _empty_like, keep=local)
    loaded = {"optim": {str(index): {"state": template}}}
    _load_shards(loaded, shards)
    named = {
        "format": NAMED_FORMAT,
        "state": loaded["optim"][str(index)]["state"],
        "param_groups": named_groups["param_groups"],
    }
    return local_optimizer_state(named, optimizer, names)


def _optimizer_state(
    entries: Mapping[str, Any], index: int, value: Callable[[Any], Any], keep: Collection[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``{param name: {field: value(entry)}}`` of optimizer ``index`` from flat DCP ``entries`` (``keep``: names)."""
    prefix = f"optim.{index}.state."
    state: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        if key.startswith(prefix):
            name, _, field = key[len(prefix) :].rpartition(".")
            if keep is None or name in keep:
                state.setdefault(name, {})[field] = value(entry)
    return state


def _load_shards(state: dict[str, Any], shards: str, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` (templates, filled in place) from ``shards``, running no code from the files."""
    with warnings.catch_warnings():  # one process reading it all (no_dist) is the point, not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        try:
            dcp.load(
                state,
                storage_reader=safe_load.SafeFileSystemReader(shards),
                planner=safe_load.SafeLoadPlanner(shards),
                no_dist=no_dist,
            )
        except CheckpointException as e:  # DCP wraps each rank's failure: a refusal is said as itself
            refused = safe_load.refusal_in(e)
            if refused is None:
                raise
            raise refused from None


def load_whole(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint (sharded directory or single file) as one single-file checkpoint dict, in one process.

    The unsplit model's ``state_dict`` and named optimizer states with all their tensors, with Lightning's other
    entries: what the single-file format holds (for inspection, export, or a plain ``torch.save``). Nothing in the
    files runs (:mod:`~dynmo_lightning.pipeline.safe_load`).

    Raises:
        CheckpointRefused: a file of the checkpoint asks for code to run.
    """
    if not is_sharded(path):
        return safe_load.load_file(path)
    meta = load_meta(path)
    shards = meta.pop(SHARDS_KEY)
    metadata = safe_load.read_dcp_metadata(shards).state_dict_metadata
    # Every saved entry by its flat DCP key, into tensors of the saved shapes (one process reads it all).
    flat = {k: _empty_like(m) for k, m in metadata.items()}
    _load_shards(flat, shards, no_dist=True)
    meta["state_dict"] = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    for i, named in enumerate(meta.get("optimizer_states") or []):
        named["state"] = _optimizer_state(flat, i, lambda v: v)
    return meta
