"""Reading checkpoint files without running code from them.

A checkpoint is data: tensors, plain Python values (numbers, strings, lists, dicts, ``None``) and, in a sharded
checkpoint's ``.metadata``, the dataclasses ``torch.distributed.checkpoint`` describes its shards with. Python's
pickle, which all three files use, can also name any importable callable and call it while it loads; a file crafted
that way would run its code in every process of a job that resumes from it. So nothing here unpickles freely:

- single files and ``meta.pt`` load with ``torch.load(weights_only=True)`` (torch's allow-list of tensor types and
  plain containers, extended only by what the user registers with ``torch.serialization.add_safe_globals``);
- ``.metadata`` is read by :class:`SafeFileSystemReader`, whose unpickler admits DCP's metadata classes, dtypes,
  sizes, paths and plain containers, and nothing else (torch's own reader uses a plain ``pickle.load``);
- non-tensor entries of the shards load through :class:`SafeLoadPlanner` with ``weights_only=True`` (torch's planner
  loads them with ``weights_only=False``).

Anything else is refused with :class:`CheckpointRefused`, naming the file and what it asked for, before it runs.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

#: The file DCP writes its metadata to (``torch.distributed.checkpoint.filesystem._metadata_fn``).
DCP_METADATA = ".metadata"

# What DCP 2.9-2.13 pickles into ``.metadata``: its metadata dataclasses, the filesystem's per-item storage record,
# sizes, dtypes and layouts, the checkpoint id (a path), plain containers.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint file asked to import or call something a checkpoint never holds; nothing of it ran."""

    def __init__(self, path: str | os.PathLike[str], refused: str) -> None:
        super().__init__(
            f"refused to load {os.fspath(path)}: it asks for {refused}, which a checkpoint never holds (only "
            "tensors, plain Python data and torch.distributed.checkpoint's metadata classes load; nothing of the "
            "file ran). Do not resume from a checkpoint of unknown origin. If the file is yours and holds an object "
            "of your own (e.g. in hyper-parameters), allow its class with torch.serialization.add_safe_globals([...])."
        )
        self.path = os.fspath(path)
        self.refused = refused

    def __reduce__(self) -> tuple[type[CheckpointRefused], tuple[str, str]]:
        # DCP gathers a rank's failure to every rank by pickling it: rebuild from the two fields, not the message.
        return type(self), (self.path, self.refused)

    @classmethod
    def from_error(cls, path: str | os.PathLike[str], error: pickle.UnpicklingError) -> CheckpointRefused:
        """The refusal of ``path`` from the error of torch's ``weights_only`` unpickler."""
        message = str(error)
        found = re.search(r"Unsupported (?:global: GLOBAL|operand) (\S+)", message)
        if found is not None:
            return cls(path, f"`{found.group(1)}`")
        return cls(path, message.splitlines()[0] if message else "an unsupported object")


def load_file(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` of ``path`` onto the CPU that runs no code from the file.

    Raises:
        CheckpointRefused: the file asks for a global outside torch's ``weights_only`` allow-list.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused.from_error(path, e) from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, resolving only the globals such a file holds."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointRefused(self._path, f"`{module}.{name}`")


def read_dcp_metadata(path: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """The DCP ``Metadata`` of the checkpoint directory ``path``, read without running code from it.

    Raises:
        CheckpointRefused: the file names a global outside DCP's metadata classes, or is not DCP metadata.
    """
    file = os.path.join(os.fspath(path), DCP_METADATA)
    with open(file, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, file).load()
        except CheckpointRefused:
            raise
        except Exception as e:  # a truncated or foreign file: say so, naming it
            raise CheckpointRefused(file, f"unreadable data ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not all(
        isinstance(i, _StorageInfo) for i in (metadata.storage_data or {}).values()
    ):
        raise CheckpointRefused(file, f"a {type(metadata).__name__} where DCP metadata belongs")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose ``.metadata`` goes through :func:`read_dcp_metadata` (no plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checkpoint's metadata, its load id set as torch's reader sets it."""
        if kwargs.get("rank") is not None:  # per-rank metadata files are a format this project never writes
            raise ValueError("SafeFileSystemReader reads the global .metadata only")
        metadata = read_dcp_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def refusal_in(error: CheckpointException) -> CheckpointRefused | None:
    """The :class:`CheckpointRefused` of any rank among the failures DCP gathered into ``error``, if any."""
    for failure in error.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointRefused):
            return exc
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads the non-tensor entries of the shards with ``weights_only=True``.

    Args:
        path: the checkpoint directory (named in the error when an entry is refused).
        **kwargs: ``DefaultLoadPlanner``'s arguments.
    """

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._path = os.fspath(path)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor entry (``torch.save`` bytes) without running code from it."""
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            where = f"{self._path} (entry {read_item.dest_index.fqn})"
            raise CheckpointRefused.from_error(where, e) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
