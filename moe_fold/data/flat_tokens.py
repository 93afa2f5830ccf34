"""Flat token memmaps: one file holding every token back to back, documents separated
by an end-of-document token and no index: OLMo/Dolma's ``.npy`` and nanoGPT's raw
``.bin`` (``train.bin`` of uint16 ids).

A ``.npy`` declares its dtype in its header; a raw ``.bin`` has none, so ``data.dtype``
must name it. The end-of-document id is ``data.eod_id`` (or the tokenizer's). Document
``i`` is the tokens up to and including the ``i``-th eod; tokens after the last eod are
one more document.

Finding the documents needs a pass over every token, so :attr:`FlatTokens.offsets` is
computed on first use only: fixed-length samples (the default) read token ranges and
never need it; packing, ``reset_at_documents`` and ``valid_fraction`` do.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path

import numpy as np

from moe_fold.config import choice, choices, require
from moe_fold.data.indexed_dataset import DatasetFormatError

# Integer dtypes a token file may hold (names as numpy spells them, little-endian): data.dtype's.
TOKEN_DTYPES = choices("data.dtype")
_SCAN_TOKENS = 1 << 24  # tokens read at a time when finding document ends


class FlatTokens:
    """A flat token file opened read-only: ``tokens`` (memmap), lazy ``offsets``/``lengths``."""

    def __init__(self, path: str | os.PathLike, eod_id: int, dtype: str | None = None):
        self.prefix = self.file = Path(path)
        if not self.file.is_file():
            raise FileNotFoundError(f"{self.file}: token file not found")
        self.eod_id, self.vocab_size = eod_id, None
        if self.file.suffix == ".npy":
            self.format = "npy"
            try:
                arr = np.load(self.file, mmap_mode="r", allow_pickle=False)
            except ValueError as e:
                raise DatasetFormatError(f"{self.file}: not a readable .npy file at byte offset 0 ({e})") from e
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise DatasetFormatError(f"{self.file}: holds a {arr.dtype} array of shape {arr.shape}: a token "
                                         f"file must be 1-D of an integer dtype")
            self.tokens = arr
        else:
            self.format = "raw"
            if dtype is None:
                raise DatasetFormatError(f"{self.file}: a raw token file has no header, so data.dtype must name its "
                                         f"dtype (one of {', '.join(TOKEN_DTYPES)}; nanoGPT writes uint16). "
                                         f"It is read as one because no {self.file.with_suffix('.idx').name} "
                                         f"is beside it")
            require(choice, "data.dtype", dtype)
            dt = np.dtype(dtype).newbyteorder("<")
            size = self.file.stat().st_size
            if size % dt.itemsize:
                raise DatasetFormatError(f"{self.file}: {size} bytes is not a whole number of {dtype} tokens: the "
                                         f"last token at byte offset {size - size % dt.itemsize} is cut "
                                         f"(truncated, or data.dtype is wrong)")
            self.tokens = np.memmap(self.file, dtype=dt, mode="r") if size else np.zeros(0, dt)
        self.dtype = self.tokens.dtype
        self.num_tokens = len(self.tokens)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Token offset of each document, [docs+1]: 0, one past each eod, then the end."""
        ends = [np.zeros(1, np.int64)]
        for start in range(0, self.num_tokens, _SCAN_TOKENS):
            chunk = np.asarray(self.tokens[start:start + _SCAN_TOKENS])
            ends.append(np.flatnonzero(chunk == self.eod_id).astype(np.int64) + start + 1)
        offsets = np.concatenate(ends)
        if offsets[-1] != self.num_tokens:
            offsets = np.append(offsets, self.num_tokens)
        return offsets

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> np.ndarray:
        n = self.num_docs
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents in {self.file}")
        i %= n
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]
