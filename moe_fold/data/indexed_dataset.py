"""Memory-mapped indexed token datasets: ``PREFIX.bin`` (token ids) + ``PREFIX.idx`` (index).

``.bin`` holds the token ids of every document back to back, uint16 when the vocabulary
fits (ids < 65536), else int32. Each document already ends with its end-of-document id.

``.idx`` (little-endian, version 1)::

    header   magic b"MOEFIDX\\0", version u32, dtype code u32 (1 uint16, 2 int32),
             vocab_size u64, eod_id u64, num_docs u64, num_tokens u64,
             block_size u64 (bytes), num_blocks u64
    body     offsets int64[num_docs + 1]   token offset of each document; lengths = diff
             block_crc uint32[num_blocks]  crc32 of each block_size-byte block of .bin
    trailer  crc32 u32 of header + body

Verification on open, and why it stays cheap for a 100 GB dataset: the index is small,
so its size and checksum are always checked; the ``.bin`` size must equal
``num_tokens * itemsize``; and ``check_blocks`` blocks of the ``.bin`` (the first, the
last and evenly spaced ones between, 8 by default) are read and crc-checked, catching a
truncated or swapped file at once. ``verify="full"`` checks every block. Any problem is
one ``DatasetFormatError`` naming the file and what is wrong.

Both files are written under temporary names and renamed into place, ``.bin`` first: a
crash leaves either no dataset or a complete one (a stale ``.idx`` beside a new ``.bin``
fails the size or checksum check); the next writer removes a killed job's temporaries
(:func:`temporary_names`).
"""

from __future__ import annotations

import abc
import glob
import os
import socket
import struct
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

from moe_fold.config import choice, require

MAGIC = b"MOEFIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQQQ")
_DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
DEFAULT_BLOCK_SIZE = 1 << 20


class DatasetFormatError(ValueError):
    """A dataset file is damaged or not a dataset; the message names the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def temporary_names(prefix: Path) -> tuple[Path, Path]:
    """Where a writer of ``prefix`` keeps its ``.bin`` and ``.idx`` until it renames them:
    ``PREFIX.bin.tmp-HOST-PID``. A job killed outright (no chance to clean up) leaves
    those behind, never a final name; the next writer of the prefix on the same host
    deletes the ones whose process is gone, so a restart leaves no stale partial files.
    Another host's, or a live process's, are left alone (concurrent builders of a cache)."""
    host = socket.gethostname().replace("-", "_")
    for stale in prefix.parent.glob(f"{glob.escape(prefix.name)}.[bi][id][nx].tmp-{glob.escape(host)}-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    tag = f".tmp-{host}-{os.getpid()}"
    return (bin_path(prefix).with_name(bin_path(prefix).name + tag),
            idx_path(prefix).with_name(idx_path(prefix).name + tag))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class PrefixWriter(abc.ABC):
    """What every writer of a ``PREFIX.bin``/``PREFIX.idx`` pair shares: both are written
    under temporary names (:func:`temporary_names`) and renamed into place by
    :meth:`_publish`, ``.bin`` first, so nothing is visible under the final names before
    ``finish()``. Use as a context manager: an exception removes the temporary files."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, eod_id: int):
        if vocab_size < 1 or not 0 <= eod_id < vocab_size:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1 and eod_id={eod_id} in [0, vocab_size)")
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.eod_id = vocab_size, eod_id
        self._bin_tmp, self._idx_tmp = temporary_names(self.prefix)
        self._bin = open(self._bin_tmp, "wb")

    def _checked_document(self, ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """``ids`` as a 1-D array, refused with the document's number if any id is outside
        the vocabulary (``num_docs``: the documents already written)."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"document {self.num_docs} has token ids in [{arr.min()}, {arr.max()}], "
                             f"outside [0, vocab_size={self.vocab_size})")
        return arr

    @abc.abstractmethod
    def finish(self) -> Path:
        """Write the format's index, then :meth:`_publish`; returns the prefix."""

    def _publish(self) -> Path:
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


class IndexedDatasetWriter(PrefixWriter):
    """Streams documents into moe-fold's ``PREFIX.bin``/``PREFIX.idx`` (:class:`PrefixWriter`)."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, eod_id: int,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        super().__init__(prefix, vocab_size, eod_id)
        self.block_size = block_size
        self.dtype = token_dtype(vocab_size)
        self._offsets = [0]
        self._block_crcs: list[int] = []
        self._crc = 0  # running crc32 of the current, unfinished block
        self._in_block = 0  # bytes of the current block written so far

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = self._checked_document(ids)
        data = memoryview(arr.astype(self.dtype, copy=False).tobytes())
        self._bin.write(data)
        while len(data):
            take = min(len(data), self.block_size - self._in_block)
            self._crc = zlib.crc32(data[:take], self._crc)
            self._in_block += take
            data = data[take:]
            if self._in_block == self.block_size:
                self._block_crcs.append(self._crc)
                self._crc, self._in_block = 0, 0
        self._offsets.append(self._offsets[-1] + int(arr.size))

    def finish(self) -> Path:
        """Write the index and move both files to their final names; returns the prefix."""
        if self._in_block:
            self._block_crcs.append(self._crc)
        self._bin.close()
        code = next(c for c, d in _DTYPES.items() if d == self.dtype)
        header = _HEADER.pack(MAGIC, VERSION, code, self.vocab_size, self.eod_id, self.num_docs,
                              self.num_tokens, self.block_size, len(self._block_crcs))
        body = (np.asarray(self._offsets, dtype="<i8").tobytes()
                + np.asarray(self._block_crcs, dtype="<u4").tobytes())
        with open(self._idx_tmp, "wb") as f:
            f.write(header + body + struct.pack("<I", zlib.crc32(header + body)))
        return self._publish()


def write_indexed_dataset(prefix: str | os.PathLike, documents: Iterable[Iterable[int]], vocab_size: int,
                          eod_id: int, block_size: int = DEFAULT_BLOCK_SIZE) -> Path:
    """Write already-tokenized documents (each ending with its eod id) as one dataset."""
    with IndexedDatasetWriter(prefix, vocab_size, eod_id, block_size) as w:
        for doc in documents:
            w.add_document(doc)
    return Path(prefix)


class DocumentIndex:
    """Reading document ``i`` of a memory-mapped token file: a subclass sets ``tokens``
    (the ``.bin``), ``offsets`` (token offset of each document, ``[docs+1]``),
    ``num_docs`` and ``prefix``."""

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents in {self.prefix}")
        i %= self.num_docs
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


class IndexedDataset(DocumentIndex):
    """A dataset opened read-only with numpy memmap (see the module docstring for the
    checks made on open). ``ds[i]`` is document ``i``; ``ds.tokens`` is every token."""

    format = "moefidx"

    def __init__(self, prefix: str | os.PathLike, verify: str = "sampled", check_blocks: int = 8):
        require(choice, "data.verify", verify)
        self.prefix = Path(prefix)
        self.idx_file, self.bin_file = idx_path(prefix), bin_path(prefix)
        for f in (self.idx_file, self.bin_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: dataset file not found (build it with `moe-fold data`)")
        self._read_index()
        self._check_bin(verify, check_blocks)
        # np.memmap cannot map an empty file.
        self.tokens = (np.memmap(self.bin_file, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.zeros(0, dtype=self.dtype))

    def _fail(self, path: Path, what: str) -> DatasetFormatError:
        return DatasetFormatError(f"{path}: {what}")

    def _read_index(self) -> None:
        raw = self.idx_file.read_bytes()
        f = self.idx_file
        if len(raw) < len(MAGIC) or raw[:len(MAGIC)] != MAGIC:
            raise self._fail(f, f"bad magic {raw[:len(MAGIC)]!r} at byte offset 0, expected {MAGIC!r}: "
                                f"not a moe-fold index file")
        if len(raw) < _HEADER.size + 4:
            raise self._fail(f, f"size mismatch: {len(raw)} bytes is shorter than the "
                                f"{_HEADER.size + 4}-byte header and trailer (truncated)")
        (_, version, code, self.vocab_size, self.eod_id, self.num_docs, self.num_tokens,
         self.block_size, num_blocks) = _HEADER.unpack_from(raw)
        if version != VERSION:
            raise self._fail(f, f"unsupported format version {version} at byte offset 8; this moe-fold reads "
                                f"version {VERSION}")
        expected = _HEADER.size + 8 * (self.num_docs + 1) + 4 * num_blocks + 4
        if len(raw) != expected:
            raise self._fail(f, f"size mismatch: {len(raw)} bytes, the header implies {expected} "
                                f"({self.num_docs} documents, {num_blocks} blocks)")
        stored, = struct.unpack_from("<I", raw, expected - 4)
        actual = zlib.crc32(raw[:expected - 4])
        if stored != actual:
            raise self._fail(f, f"checksum mismatch: crc32 of the index is {actual:#010x}, "
                                f"stored {stored:#010x} (the index is damaged)")
        if code not in _DTYPES:
            raise self._fail(f, f"unknown token dtype code {code}")
        self.dtype = _DTYPES[code]
        self.offsets = np.frombuffer(raw, dtype="<i8", count=self.num_docs + 1, offset=_HEADER.size)
        self.block_crcs = np.frombuffer(raw, dtype="<u4", count=num_blocks,
                                        offset=_HEADER.size + 8 * (self.num_docs + 1))
        self.lengths = np.diff(self.offsets)
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens or (self.lengths < 0).any():
            raise self._fail(f, f"document offsets are inconsistent: they must rise from 0 to "
                                f"num_tokens={self.num_tokens}")

    def _check_bin(self, verify: str, check_blocks: int) -> None:
        f = self.bin_file
        size = f.stat().st_size
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise self._fail(f, f"size mismatch: the file ends at byte offset {size}, the index "
                                f"{self.idx_file.name} says {expected} bytes ({self.num_tokens} tokens of "
                                f"{self.dtype.name}): the .bin must be exactly that size")
        n = len(self.block_crcs)
        if verify == "full" or n <= check_blocks:
            blocks = range(n)
        else:
            blocks = sorted(set(np.linspace(0, n - 1, check_blocks).round().astype(int).tolist()))
        with open(f, "rb") as fh:
            for b in blocks:
                fh.seek(b * self.block_size)
                actual = zlib.crc32(fh.read(self.block_size))
                if actual != self.block_crcs[b]:
                    lo = b * self.block_size
                    hi = min(lo + self.block_size, size)
                    raise self._fail(f, f"checksum mismatch in bytes [{lo}, {hi}) (block {b}): crc32 "
                                        f"{actual:#010x}, the index says {int(self.block_crcs[b]):#010x}")
