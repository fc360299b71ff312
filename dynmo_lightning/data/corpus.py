"""A byte-level corpus made from the Python standard library's own sources.

Every machine that runs this project already has the corpus, so training needs no download, no tokenizer and no
cache: the token of a byte is its value. The file list is sorted, which makes the corpus identical in every process.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

VOCAB_SIZE = 256
"""Number of distinct tokens: one per byte value."""

# Test suites are skipped because they hold deliberately odd files (bad encodings, huge literals) and would dominate
# the stream; site-/dist-packages are third-party code that differs between environments.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """List the ``.py`` files of the corpus in their fixed order.

    Args:
        root: Directory to scan. Defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        The files under ``root``, sorted by their relative POSIX path, without test directories, ``site-packages``
        and build-generated configuration.

    Raises:
        ValueError: If ``root`` is not a directory.

    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"corpus root {str(base)!r} is not a directory; pass `root=` pointing at Python sources.")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # `config-*` and `_sysconfigdata_*` are written when Python is built and embed machine-specific paths.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata_"):
                path = Path(dirpath, name)
                found.append((path.relative_to(base).as_posix(), path))
    # Sort on the POSIX string, not on os.walk order, which depends on the file system.
    return [path for _, path in sorted(found)]


def build_corpus(
    max_bytes: int = 4_000_000,
    *,
    root: str | os.PathLike[str] | None = None,
    separator: bytes = b"\n",
) -> bytes:
    """Concatenate the standard library's sources into one deterministic byte string.

    Args:
        max_bytes: Length cap; the result is truncated to at most this many bytes.
        root: Directory to read instead of the running interpreter's standard library.
        separator: Bytes placed between two files, so a file never runs into the next one's first line.

    Returns:
        The concatenated file contents, at most ``max_bytes`` long (shorter only if ``root`` holds less).

    Raises:
        ValueError: If ``max_bytes`` is below 1 or ``root`` is not a directory.

    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be at least 1.")
    parts: list[bytes] = []
    size = 0
    for path in stdlib_source_files(root):
        if size >= max_bytes:
            break
        try:
            content = path.read_bytes()
        except OSError:
            # Broken symlinks or permission-restricted files in odd installations; the corpus just goes without them.
            continue
        if parts:
            parts.append(separator)
            size += len(separator)
        parts.append(content)
        size += len(content)
    return b"".join(parts)[:max_bytes]


def encode(text: str) -> Tensor:
    """Turn text into tokens (its UTF-8 bytes), e.g. for a generation prompt.

    Args:
        text: Any string.

    Returns:
        A 1-D ``int64`` tensor of byte values.

    """
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: Tensor | Iterable[int] | bytes) -> str:
    """Turn tokens back into printable text.

    Args:
        tokens: Byte values in ``[0, 256)``: a 1-D tensor, any iterable of ints, or ``bytes``.

    Returns:
        The UTF-8 decoded text; a multi-byte character cut by a window edge shows as U+FFFD.

    """
    if isinstance(tokens, Tensor):
        tokens = tokens.reshape(-1).tolist()
    return bytes(tokens).decode("utf-8", errors="replace")


def split_point(n_tokens: int, val_fraction: float) -> int:
    """Index where validation starts: the last ``val_fraction`` of the stream is validation.

    Args:
        n_tokens: Length of the whole token stream.
        val_fraction: Share of the stream held out, in ``(0, 1)``.

    Returns:
        The number of training tokens.

    """
    return n_tokens - int(n_tokens * val_fraction)


class CharWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping fixed-length windows over a token stream, for next-token prediction.

    Sample ``i`` is ``x = tokens[i * block_size : i * block_size + block_size + 1]`` returned as ``(x[:-1], x[1:])``;
    the one-token overlap between neighbouring windows is only the last target.

    Args:
        tokens: 1-D tensor of token ids (any integer dtype; ``uint8`` keeps the corpus small in memory).
        block_size: Sequence length of inputs and targets.

    """

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}.")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1.")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows.")
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1].to(torch.int64)
        return window[:-1], window[1:]
