"""Byte-level corpus of the Python standard library's sources, and its LightningDataModule."""

from dynmo_lightning.data.corpus import (
    VOCAB_SIZE,
    CharWindowDataset,
    build_corpus,
    decode,
    encode,
    split_point,
    stdlib_source_files,
)
from dynmo_lightning.data.datamodule import StdlibCharDataModule

__all__ = [
    "VOCAB_SIZE",
    "CharWindowDataset",
    "StdlibCharDataModule",
    "build_corpus",
    "decode",
    "encode",
    "split_point",
    "stdlib_source_files",
]
