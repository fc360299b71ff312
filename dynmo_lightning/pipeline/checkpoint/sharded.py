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
path or, for an instant, at ``<path>.old``). In the background (``async_checkpoint``), the shards are copied to host
memory and written by DCP's ``async_save`` from a thread, over a gloo group of the writers of their own (the
training's collectives go on meanwhile on the others); the last writer to finish is the coordinator, which then puts
the directory at its name (``pipeline/topology/pending.py`` waits for it before the world changes or ends).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.optim import Optimizer

from dynmo_lightning.pipeline.checkpoint import safe_load
from dynmo_lightning.pipeline.checkpoint.single_file import (
    NAMED_FORMAT,
    check_keys,
    gather_checkpoint,
    load_local_state,
    local_optimizer_state,
    merge_named_optimizer_states,
    shard_optimizer_state,
)
from dynmo_lightning.pipeline.parallel.dtensors import full_tensors, template_like
from dynmo_lightning.pipeline.topology import pending
from dynmo_lightning.pipeline.topology.mesh import Mesh, PipelineGroup

#: Checkpoint formats: ``"sharded"`` (a DCP directory, every stage writes its part), ``"single"`` (one file gathered
#: on rank 0), ``"auto"`` (sharded when the pipeline has more than one stage).
FORMATS = ("auto", "sharded", "single")

#: The file of a sharded checkpoint that holds everything but the tensors.
META = "meta.pt"

#: Key of the loaded metadata that says where the shards are (the strategy reads its stage's part from there).
SHARDS_KEY = "dynmo_shards"


def complete_directory(path: str | os.PathLike[str]) -> Path | None:
    """The complete sharded checkpoint at ``path`` (or at ``<path>.old``, where a swap was interrupted), if any."""
    for d in (Path(path), Path(os.fspath(path) + ".old")):
        if (d / META).is_file():
            return d
    return None


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sharded (directory) checkpoint."""
    return complete_directory(path) is not None


def _tensors(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors this stage writes: its model state and the per-parameter optimizer states (named format)."""
    optim = {str(i): {"state": dict(o["state"])} for i, o in enumerate(checkpoint.get("optimizer_states") or [])}
    return {"model": dict(checkpoint.get("state_dict", {})), "optim": optim}


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str],
    mesh: Mesh,
    checkpoint_format: str,
    in_parts: bool,
    dtensors: bool,
    background: bool = False,
) -> dict[str, Any] | None:
    """Write this process's part of ``checkpoint`` (collective over the writers; Lightning's ``save_checkpoint``).

    Pipelines that hold the same tensors (data-parallel replicas) are identical: the first one writes. Where
    processes hold parts of their layers (``in_parts``: FSDP2 shards, tensor-parallel splits), every process writes
    its parts of a sharded checkpoint (:func:`save_sharded`). A single file (``checkpoint_format``, or a remote
    path) holds whole tensors: every process joins in gathering its DTensors (``dtensors``), then the first
    pipeline's stages are merged. ``background``: a sharded checkpoint is written from a thread (module docstring);
    every process waits here for the previous background save first.

    Returns:
        The merged single-file checkpoint on global rank 0 (the caller writes it with its ``CheckpointIO``), else
        ``None``.
    """
    layout, pipe = mesh.layout, mesh.pipeline
    first = layout.row(pipe.global_rank(pipe.rank)) == 0
    auto = layout.pp_size > 1 or in_parts
    split = checkpoint_format == "sharded" or (checkpoint_format == "auto" and auto)
    split = split and "://" not in os.fspath(path)  # DCP's writer is a file system's (remote: one file)
    thread_group = None
    if background and split:
        pending.settle()  # one background save at a time; its failure is raised here
        ranks = range(dist.get_world_size()) if in_parts else layout.replicas[0]
        thread_group = writer_group(ranks)  # collective over the world: before the non-writers leave
    if not (first or in_parts):
        return None
    if split:
        writers = (mesh.control, layout.global_rank(0, 0), first) if in_parts else None
        save_sharded(checkpoint, path, pipe, shards=writers, thread_group=thread_group)
        return None
    if dtensors:  # one file: whole tensors (gathered over the processes holding their parts)
        checkpoint["state_dict"] = full_tensors(checkpoint.get("state_dict", {}))
        checkpoint["optimizer_states"] = full_tensors(checkpoint.get("optimizer_states"))
    return gather_checkpoint(checkpoint, pipe) if first else None


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str],
    pipe: PipelineGroup,
    *,
    shards: tuple[dist.ProcessGroup | None, int, bool] | None = None,
    thread_group: dist.ProcessGroup | None = None,
) -> None:
    """Write ``checkpoint`` (this stage's part) as a sharded checkpoint at ``path`` (collective over the writers).

    Args:
        checkpoint: Lightning's checkpoint dict on this stage: ``state_dict`` holds this stage's tensors,
            ``optimizer_states`` its named optimizer states; the rest is the same on every stage.
        path: the checkpoint directory.
        pipe: this process's pipeline: the first replica's stages write (replicas are identical).
        shards: when every replica holds shards of its stage's layers (FSDP2), every process writes its shards:
            ``(the job's CPU group, global rank of pipeline rank 0 of the first replica, whether this process is in
            the first replica)``.
        thread_group: write in the background over this group of the same writers (:func:`writer_group`); the
            checkpoint is at ``path`` once every writer's thread finished.
    """
    target = os.fspath(path)
    group, leader, first = (pipe.control, pipe.global_rank(0), True) if shards is None else shards
    # One temporary directory for all writers, named by the leader (pipeline rank 0 of the first replica).
    tag = [uuid.uuid4().hex if dist.get_rank() == leader else None]
    dist.broadcast_object_list(tag, src=leader, group=group)
    tmp = f"{target}.tmp-{tag[0]}"
    if thread_group is not None:
        _save_in_background(checkpoint, tmp, target, pipe, first, thread_group)
        return
    # DCP's own collectives exchange plans and metadata (host data): the CPU group carries them. Entries every
    # replica holds whole (buffers, step counters) are written once: DCP dedups them.
    dcp.save(_tensors(checkpoint), storage_writer=dcp.FileSystemWriter(tmp), process_group=group)
    if first:
        _save_meta(checkpoint, tmp, target, pipe)
    dist.barrier(group=group)


def _save_in_background(
    checkpoint: dict[str, Any], tmp: str, target: str, pipe: PipelineGroup, first: bool, group: dist.ProcessGroup
) -> None:
    """Copy this writer's tensors to host memory and write them from a thread; the coordinator renames at the end.

    ``meta.pt`` is written now (it is small and gathered over the pipeline's group, which the training uses too).
    DCP's coordinator (the group's first rank: pipeline rank 0 of the first replica, as for ``meta.pt``) finishes
    the save after every writer's data is written, so when its thread returns, the directory is complete.
    """
    os.makedirs(tmp, exist_ok=True)
    if first:
        _save_meta(checkpoint, tmp, target, pipe, replace=False)
    written = dcp.async_save(_tensors(checkpoint), storage_writer=dcp.FileSystemWriter(tmp), process_group=group)
    coordinator = dist.get_rank(group) == 0
    done: Future[None] = Future()

    def finish(future: Future[Any]) -> None:
        try:
            future.result()
            if coordinator:
                _replace(tmp, target)
            done.set_result(None)
        except BaseException as e:  # raised where the next save or a change of the world settles it
            done.set_exception(e)

    written.add_done_callback(finish)
    pending.track(f"checkpoint save {target}", done)


_writer_groups: tuple[Any, dict[tuple[int, ...], dist.ProcessGroup]] = (None, {})


def writer_group(ranks: Collection[int]) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` for background writes, one per world (collective: every process calls it).

    The background thread's collectives (DCP's plans and metadata) need a group no training collective uses: two
    threads issuing collectives on one group could pair one process's with another's.
    """
    global _writer_groups
    world = dist.group.WORLD
    if _writer_groups[0] is not world:  # a new world: the old one's groups were destroyed with it
        _writer_groups = (world, {})
    key = tuple(sorted(ranks))
    groups = _writer_groups[1]
    if key not in groups:
        groups[key] = dist.new_group(list(key), backend="gloo")
    return groups[key]


def _save_meta(
    checkpoint: dict[str, Any], tmp: str, target: str, pipe: PipelineGroup, *, replace: bool = True
) -> None:
    """Everything but the tensors, by pipeline rank 0 (collective over the first replica's pipeline)."""
    # Parameter groups: hyper-parameters and the names of every stage's parameters (names only, no tensors).
    groups = [{"format": NAMED_FORMAT, "state": {}, "param_groups": o["param_groups"]} for o in
              checkpoint.get("optimizer_states") or []]  # fmt: skip
    parts: list[Any] | None = [None] * pipe.size if pipe.rank == 0 else None
    dist.gather_object(groups, parts, dst=pipe.global_rank(0), group=pipe.control)
    if parts is not None:
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta["optimizer_states"] = [merge_named_optimizer_states([p[i] for p in parts]) for i in range(len(groups))]
        torch.save(meta, os.path.join(tmp, META))
        if replace:
            _replace(tmp, target)


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
    d = complete_directory(path)
    if d is None:
        raise FileNotFoundError(f"{os.fspath(path)} is not a sharded checkpoint (it has no {META})")
    meta = safe_load.load_file(d / META)
    if not isinstance(meta, dict):
        raise ValueError(f"{d / META} holds a {type(meta).__name__}, not a checkpoint's entries")
    meta[SHARDS_KEY] = os.fspath(d)
    meta["state_dict"] = {}  # each stage reads its own part: load_stage_model
    return meta


def load_model(
    module: nn.Module, checkpoint: Mapping[str, Any], global_keys: set[str], strict: bool, group: Any = None
) -> None:
    """Load this stage's part of ``checkpoint`` (sharded: from its shards; a single file: its ``state_dict``)."""
    if SHARDS_KEY in checkpoint:
        load_stage_model(module, checkpoint[SHARDS_KEY], global_keys, strict, group)
    else:
        load_local_state(module, checkpoint["state_dict"], global_keys, strict)


def load_optimizers(
    optimizers: Sequence[Optimizer],
    checkpoint: Mapping[str, Any],
    names: Mapping[int, str],
    group: Any,
    device: torch.device,
) -> None:
    """Load this stage's part of every optimizer's state (by parameter name) into ``optimizers``, on ``device``.

    State of a parameter held in parts (FSDP2, tensor parallelism) is laid out as the parameter.
    """
    shards = checkpoint.get(SHARDS_KEY)
    for i, (optimizer, saved) in enumerate(zip(optimizers, checkpoint["optimizer_states"], strict=True)):
        if shards is not None:
            optimizer.load_state_dict(load_stage_optimizer(optimizer, i, saved, shards, names, group))
        else:
            optimizer.load_state_dict(local_optimizer_state(saved, optimizer, names))
        _optimizer_to_device(optimizer, device)
        shard_optimizer_state(optimizer)


def load_stage_model(
    module: nn.Module, shards: str, global_keys: set[str], strict: bool, group: dist.ProcessGroup | None = None
) -> None:
    """Read this stage's tensors of ``module`` from ``shards`` into it, in place (collective over the world).

    A tensor the module holds as a DTensor (FSDP2) is read as one: each process reads only its part. ``group`` is
    the job's CPU group (``None``: the default group), over which DCP agrees its plans.

    Raises:
        RuntimeError: the checkpoint does not match the model (keys missing on either side, other shapes).
    """
    metadata = safe_load.read_dcp_metadata(shards).state_dict_metadata
    saved = {k.removeprefix("model."): m for k, m in metadata.items() if k.startswith("model.")}
    local = module.state_dict()
    if strict:
        check_keys(local.keys(), saved.keys(), global_keys)
    # Read into tensors of the saved shapes: a pruned layer takes its shapes from the checkpoint when it loads.
    wanted = {k: _empty_like(saved[k], local[k]) for k in local if k in saved}
    _load_shards({"model": wanted}, shards, group=group)
    module.load_state_dict(wanted, strict=False)


def _empty_like(meta: Any, like: Any = None) -> Any:
    """An empty tensor of a saved tensor's shape and dtype (``None`` for a saved object: DCP replaces it).

    Laid out as ``like`` where that is a DTensor (see
    :func:`~dynmo_lightning.pipeline.parallel.dtensors.template_like`).
    """
    if isinstance(meta, TensorStorageMetadata):
        return template_like(meta.size, meta.properties.dtype, like)
    assert isinstance(meta, BytesStorageMetadata)
    return None


def load_stage_optimizer(
    optimizer: Optimizer,
    index: int,
    named_groups: Mapping[str, Any],
    shards: str,
    names: Mapping[int, str],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """This stage's part of optimizer ``index``'s state, in ``optimizer.load_state_dict`` form (collective).

    The state's shapes come from the checkpoint's metadata, so it loads into an optimizer that has not stepped yet;
    state of a parameter's shape is read as that parameter is laid out (a DTensor's part under FSDP2).
    """
    metadata = safe_load.read_dcp_metadata(shards).state_dict_metadata
    params = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}

    def empty(name: str, entry: Any) -> Any:
        like = params[name]
        same = isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(like.shape)
        return _empty_like(entry, like if same else None)

    template = _optimizer_state(metadata, index, empty, keep=set(params))
    loaded = {"optim": {str(index): {"state": template}}}
    _load_shards(loaded, shards, group=group)
    named = {
        "format": NAMED_FORMAT,
        "state": loaded["optim"][str(index)]["state"],
        "param_groups": named_groups["param_groups"],
    }
    return local_optimizer_state(named, optimizer, names)


def _optimizer_state(
    entries: Mapping[str, Any], index: int, value: Callable[[str, Any], Any], keep: Collection[str] | None = None
) -> dict[str, dict[str, Any]]:
    """``{param name: {field: value(name, entry)}}`` of optimizer ``index`` from flat DCP ``entries``.

    ``keep``: the parameter names wanted (``None``: all).
    """
    prefix = f"optim.{index}.state."
    state: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        if key.startswith(prefix):
            name, _, field = key[len(prefix) :].rpartition(".")
            if keep is None or name in keep:
                state.setdefault(name, {})[field] = value(name, entry)
    return state


def _load_shards(
    state: dict[str, Any], shards: str, *, no_dist: bool = False, group: dist.ProcessGroup | None = None
) -> None:
    """``dcp.load`` of ``state`` (templates, filled in place) from ``shards``, running no code from the files.

    ``group``: the CPU group DCP agrees its plans over (``None``: the default group).
    """
    with warnings.catch_warnings():  # one process reading it all (no_dist) is the point, not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        try:
            dcp.load(
                state,
                storage_reader=safe_load.SafeFileSystemReader(shards),
                planner=safe_load.SafeLoadPlanner(shards),
                process_group=group,
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
    files runs (:mod:`~dynmo_lightning.pipeline.checkpoint.safe_load`).

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
        named["state"] = _optimizer_state(flat, i, lambda _name, v: v)
    return meta
