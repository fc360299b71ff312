"""Partition-independent checkpoints: one file with the unsplit model's keys, written atomically.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in the optimizer, which differs between
stages and between partitions. DynMo stores optimizer state by the unsplit model's parameter names instead, so a
checkpoint written with P stages loads with any other P (and each stage picks out its own parameters).
:func:`gather_checkpoint` merges the stages' parts on pipeline rank 0, :func:`load_local_state` loads a stage's part
back, and :class:`AtomicCheckpointIO` (the strategy's ``CheckpointIO``) writes through a temporary file.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from dynmo_lightning.pipeline.checkpoint.safe_load import CheckpointRefused
from dynmo_lightning.pipeline.parallel.dtensors import shard_like
from dynmo_lightning.pipeline.topology import transport
from dynmo_lightning.pipeline.topology.mesh import PipelineGroup
from dynmo_lightning.pipeline.topology.ranks import ReplicaLayout

#: Marks optimizer state written in the named format.
NAMED_FORMAT = "dynmo-named-v1"

#: Why ``weights_only=False`` is refused (``trainer.fit(..., weights_only=False)``).
UNSAFE_LOAD = (
    "weights_only=False: DynMoStrategy loads every checkpoint with weights_only=True, so that no file it reads can run "
    "code (docs/checkpoints.md). Drop the argument; allow classes of your own that your checkpoints hold with "
    "torch.serialization.add_safe_globals([...])."
)


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


def shard_optimizer_state(optimizer: Optimizer) -> None:
    """Lay out whole state tensors of sharded parameters (a loaded single file) as their parameters (FSDP2)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, Tensor) and tuple(v.shape) == tuple(p.shape):
                    state[k] = shard_like(v, p)


# ---------------------------------------------------------------------------------------------------------------------
# One file from all stages
# ---------------------------------------------------------------------------------------------------------------------
def gather_checkpoint(checkpoint: dict[str, Any], pipe: PipelineGroup) -> dict[str, Any] | None:
    """The whole model's checkpoint on pipeline rank 0 (``None`` elsewhere; collective over the pipeline).

    Every stage sends its part of the model state (the unsplit model's keys) and its named optimizer states, moved
    to the CPU; pipeline rank 0 merges them into ``checkpoint``'s other entries (loops, callbacks, schedulers). The
    parts travel over the pipeline's CPU control group (gloo), one stage after the other: rank 0 then holds the
    merged checkpoint and one stage's pickle at a time, in host memory (a gather over NCCL would stage every part on
    its GPU at once).
    """
    part = move_data_to_device(
        {"state_dict": checkpoint.get("state_dict", {}), "optimizer_states": checkpoint.get("optimizer_states")}, "cpu"
    )
    # A view pickles its whole storage (the MoE experts' views of one block would send the block once per expert).
    part = apply_to_collection(part, Tensor, _own_storage)
    if pipe.rank != 0:
        transport.send_header(part, pipe.global_rank(0), pipe)
        return None
    parts = [part, *(transport.recv_header(pipe.global_rank(rank), pipe) for rank in range(1, pipe.size))]
    merged = dict(checkpoint)
    merged["state_dict"] = {k: v for p in parts for k, v in p["state_dict"].items()}
    if parts[0]["optimizer_states"] is not None:
        merged["optimizer_states"] = [
            merge_named_optimizer_states([p["optimizer_states"][i] for p in parts])
            for i in range(len(parts[0]["optimizer_states"]))
        ]
    return merged


def _own_storage(t: Tensor) -> Tensor:
    """``t``, or a copy of it where it views a larger storage."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def record_layout(partitions: list[dict[str, Any]], world_size: int, layout: ReplicaLayout) -> dict[str, Any]:
    """What a checkpoint records of the job: the partitions, the world, and how the data was divided.

    ``data_parallel_size`` is the number of sampler shards, ``replicas`` the replicas that split their batches.
    """
    return {
        "partitions": partitions,
        "world_size": world_size,
        "data_parallel_size": layout.n_shards,
        "replicas": layout.dp_size,
    }


def warn_layout_change(checkpoint: Mapping[str, Any], path: _PATH, dp_size: int) -> None:
    """Warn when resuming a run whose released processes had become replicas with another layout than this job's."""
    saved = checkpoint.get("dynmo", {})
    shards, replicas = saved.get("data_parallel_size", 1), saved.get("replicas", 1)
    if replicas != shards and replicas != dp_size:
        rank_zero_warn(
            f"{os.fspath(path)} was written by {replicas} replicas that split the batches of {shards} data shard(s) "
            f"(released processes had become replicas). This job runs {dp_size} replica(s) with data.batch_size "
            f"per replica: to keep the global batch of the saved run, use strategy.data_parallel_size={replicas} "
            f"and divide data.batch_size by {replicas // max(shards, 1)}."
        )


def check_keys(local: Iterable[str], saved: Collection[str], global_keys: Collection[str]) -> None:
    """Refuse a checkpoint whose keys do not match the model.

    Every one of this stage's ``local`` keys must be saved, and no saved key may lie outside the unsplit model's
    ``global_keys``.

    Raises:
        RuntimeError: naming the first missing and unexpected keys.
    """
    missing = [k for k in local if k not in saved]
    unexpected = [k for k in saved if k not in global_keys]
    if missing or unexpected:
        raise RuntimeError(
            "The checkpoint does not match the model: "
            f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. "
            "Was it written for a different model configuration?"
        )


def load_local_state(module: nn.Module, saved: Mapping[str, Any], global_keys: set[str], strict: bool) -> None:
    """Load this stage's part of a whole-model state dict into ``module`` (which holds this stage's layers).

    A tensor the module holds sharded (FSDP2) takes this process's part of the whole one in the file.

    Raises:
        RuntimeError: the checkpoint does not match the model (missing or unexpected keys, other shapes).
    """
    local = module.state_dict()
    if strict:
        check_keys(local.keys(), saved.keys(), global_keys)
    try:
        # a whole tensor of the file goes into a sharded one (FSDP2) as this process's part of it
        module.load_state_dict({k: shard_like(saved[k], local[k]) for k in local if k in saved}, strict=strict)
    except RuntimeError as e:
        details = [line.strip() for line in str(e).splitlines()[1:]]
        more = f" and {len(details) - 3} more" if len(details) > 3 else ""
        raise RuntimeError(
            f"The checkpoint does not match the model ({'; '.join(details[:3])}{more}). Was it written for a "
            "different model configuration?"
        ) from e


class AtomicCheckpointIO(_WrappingCheckpointIO):
    """Writes through the wrapped ``CheckpointIO`` to a temporary file in the same directory, then renames it.

    A crash (or a lost process) mid-write never leaves a half-written checkpoint where the previous one was. Paths
    with a URL scheme (``s3://``, ...) are written directly: renaming is the storage's business there. Reading
    turns an unreadable file into an error that says what to do; a local file written by Lightning's
    ``TorchCheckpointIO`` is mapped, not read (``torch.load(mmap=True)``): a process resuming one stage of a large
    model reads only its own layers' tensors from it, instead of holding the whole model.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        assert self.checkpoint_io is not None
        target = os.fspath(path)
        if "://" in target:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        tmp = f"{target}.tmp-{os.getpid()}"
        self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        os.replace(tmp, target)

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, **kwargs: Any) -> dict[str, Any]:
        assert self.checkpoint_io is not None
        try:
            checkpoint = self._mapped(path, kwargs.get("weights_only"))
            if checkpoint is None:
                checkpoint = self.checkpoint_io.load_checkpoint(path, map_location=map_location, **kwargs)
        except FileNotFoundError:
            raise
        except pickle.UnpicklingError as e:  # the loader refused what the file asked for: say so, not "truncated"
            raise CheckpointRefused.from_error(path, e) from None
        except Exception as e:
            raise ValueError(
                f"ckpt_path={os.fspath(path)} is not a readable checkpoint ({type(e).__name__}: {e}); it may be "
                "truncated or not a Lightning checkpoint. Resume from an earlier one (checkpoints are written to a "
                "temporary file and renamed, so the previous one is always complete)."
            ) from e
        if "state_dict" not in checkpoint:
            raise ValueError(f"ckpt_path={os.fspath(path)} has no 'state_dict': not a training checkpoint")
        return checkpoint

    def _mapped(self, path: _PATH, weights_only: bool | None) -> dict[str, Any] | None:
        """The checkpoint at a local ``path`` mapped into memory (its tensors read where used); ``None`` otherwise.

        Only for Lightning's own ``TorchCheckpointIO`` (another one may read differently) and a file of torch's zip
        format (the one ``torch.save`` writes; an older one is read the wrapped way).
        """
        target = os.fspath(path)
        if type(self.checkpoint_io) is not TorchCheckpointIO or "://" in target or not zipfile.is_zipfile(target):
            return None
        return torch.load(target, map_location="cpu", weights_only=weights_only is not False, mmap=True)
