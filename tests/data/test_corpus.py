import os
import sysconfig
from pathlib import Path

import pytest
import torch

from dynmo_lightning.data import (
    VOCAB_SIZE,
    CharWindowDataset,
    build_corpus,
    decode,
    encode,
    split_point,
    stdlib_source_files,
)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    """A miniature standard library: kept files plus every kind of file the corpus must skip."""
    _write(tmp_path, "b.py", "B\n")
    _write(tmp_path, "a.py", "A\n")
    _write(tmp_path, "pkg/z.py", "Z\n")
    _write(tmp_path, "pkg/sub/m.py", "M\n")
    _write(tmp_path, "a_b.py", "AB\n")
    _write(tmp_path, "notes.txt", "not python\n")
    _write(tmp_path, "test/test_a.py", "skip\n")
    _write(tmp_path, "pkg/tests/t.py", "skip\n")
    _write(tmp_path, "idlelib/idle_test/t.py", "skip\n")
    _write(tmp_path, "idlelib/run.py", "R\n")
    _write(tmp_path, "site-packages/third.py", "skip\n")
    _write(tmp_path, "config-3.11-x86_64-linux-gnu/python-config.py", "skip\n")
    _write(tmp_path, "_sysconfigdata__linux.py", "skip\n")
    # A dangling symlink stands in for an unreadable file (permissions do not stop root).
    os.symlink(tmp_path / "missing.py", tmp_path / "broken.py")
    return tmp_path


def test_fake_tree_file_list_is_sorted_and_filtered(fake_stdlib: Path) -> None:
    rel = [p.relative_to(fake_stdlib).as_posix() for p in stdlib_source_files(fake_stdlib)]
    assert rel == ["a.py", "a_b.py", "b.py", "broken.py", "idlelib/run.py", "pkg/sub/m.py", "pkg/z.py"]


def test_fake_tree_corpus_concatenates_in_order_and_skips_unreadable(fake_stdlib: Path) -> None:
    assert build_corpus(root=fake_stdlib) == b"A\n\nAB\n\nB\n\nR\n\nM\n\nZ\n"
    assert build_corpus(root=fake_stdlib, separator=b"") == b"A\nAB\nB\nR\nM\nZ\n"
    assert build_corpus(5, root=fake_stdlib) == b"A\n\nAB"


def test_stdlib_file_list_is_sorted_and_has_no_tests_or_site_packages() -> None:
    files = stdlib_source_files()
    assert len(files) > 100
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    for path in files:
        assert path.suffix == ".py"
        assert not {"site-packages", "test", "tests", "idle_test"} & set(path.relative_to(root).parts)


def test_stdlib_corpus_is_deterministic_and_truncated() -> None:
    first = build_corpus(50_000)
    assert len(first) == 50_000
    assert build_corpus(50_000) == first
    assert build_corpus(60_000).startswith(first)
    assert first.startswith(stdlib_source_files()[0].read_bytes())


def test_build_corpus_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes=0 must be at least 1"):
        build_corpus(0)
    with pytest.raises(ValueError, match="is not a directory"):
        build_corpus(root=tmp_path / "nowhere")


def test_encode_decode_round_trip() -> None:
    text = "def f(x):\n    return 'é' * x\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64
    assert int(tokens.max()) < VOCAB_SIZE == 256
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text
    assert decode(text.encode()) == text
    # A window edge can cut a multi-byte character; decoding must still print.
    cut = text.encode().index("é".encode()) + 1
    assert decode(tokens[:cut]).endswith("'\ufffd")


def test_split_point_holds_out_the_tail_fraction() -> None:
    assert split_point(1000, 0.05) == 950
    assert split_point(1000, 0.1) == 900
    assert split_point(999, 0.1) == 900  # the validation share rounds down


def test_windows_are_shifted_by_one_and_do_not_overlap() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    ds = CharWindowDataset(tokens, block_size=5)
    assert len(ds) == 4  # (23 - 1) // 5: the last window needs one extra token for its final target
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (5,)
        assert torch.equal(x, torch.arange(5 * i, 5 * i + 5))
        assert torch.equal(y[:-1], x[1:])
        assert int(y[-1]) == int(x[-1]) + 1
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds[-1]


def test_window_dataset_edge_cases() -> None:
    assert len(CharWindowDataset(torch.zeros(5, dtype=torch.uint8), block_size=5)) == 0
    assert len(CharWindowDataset(torch.zeros(6, dtype=torch.uint8), block_size=5)) == 1
    with pytest.raises(ValueError, match="block_size=0 must be at least 1"):
        CharWindowDataset(torch.zeros(6), block_size=0)
    with pytest.raises(ValueError, match="1-D"):
        CharWindowDataset(torch.zeros(2, 3), block_size=1)
