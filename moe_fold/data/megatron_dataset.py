"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, magic ``MMIDIDX``),
read in place and written, so a corpus made by Megatron-LM's ``preprocess_data.py``
trains here unchanged and ``moe-fold data --format megatron`` makes one Megatron reads.

The published layout (``megatron/core/datasets/indexed_dataset.py``), all little-endian::

    .idx  magic     9 bytes  b"MMIDIDX\\x00\\x00"
          version   u64      1
          dtype     u8       token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32,
                             5 int64, 6 float64, 7 float32, 8 uint16
          seq_count u64      number of sequences
          doc_count u64      number of document indices (documents + 1)
          lengths   int32[seq_count]  tokens of each sequence
          pointers  int64[seq_count]  byte offset of each sequence in .bin
          doc_idx   int64[doc_count]  sequence index where each document starts,
                                      0 first and seq_count last
          (modes    int8[seq_count]   multimodal datasets only; not read here)
    .bin  the tokens of every sequence, back to back

A sequence is a sentence when the corpus was split into sentences, else a whole
document; a document here is the sequences between two document indices, so the
token stream and the document boundaries are the ones Megatron trains on. The dtype is
whatever the file declares (preprocess_data.py picks uint16 below 65,500 tokens of
vocabulary, else int32); float codes are accepted when their values are whole numbers.

Megatron keeps no vocabulary size or end-of-document id in the files: the model's
``model.vocab_size`` bounds the ids (see :mod:`moe_fold.data.sources`) and
``data.eod_id`` (or the tokenizer's) fills padding.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Iterable

import numpy as np

from moe_fold.data.indexed_dataset import DatasetFormatError, DocumentIndex, PrefixWriter, bin_path, idx_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, seq_count, doc_count: 34 bytes
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
          5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
CODES = {d: c for c, d in DTYPES.items()}


def megatron_token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron-LM's preprocess_data.py gives a vocabulary of this size."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class MegatronDataset(DocumentIndex):
    """A Megatron ``MMIDIDX`` dataset opened read-only (numpy memmap of the ``.bin``).

    Same reading interface as :class:`moe_fold.data.indexed_dataset.IndexedDataset`:
    ``tokens`` (every token), ``offsets``/``lengths`` (per document), ``ds[i]``.
    Every rule of the layout is checked on open, each failure one ``DatasetFormatError``
    naming the file, the byte offset and the rule."""

    format = "megatron"

    def __init__(self, prefix: str | os.PathLike, eod_id: int):
        self.prefix = Path(prefix)
        self.idx_file, self.bin_file = idx_path(prefix), bin_path(prefix)
        for f in (self.idx_file, self.bin_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: dataset file not found")
        self.eod_id = eod_id
        self.vocab_size = None  # not stored by Megatron: the model's vocabulary bounds the ids
        self._read_index()
        self.num_tokens = int(self.offsets[-1])
        bin_size, need = self.bin_file.stat().st_size, self.num_tokens * self.dtype.itemsize
        if bin_size != need:
            what = (f"ends at byte offset {bin_size}" if bin_size < need
                    else f"has {bin_size - need} bytes past byte offset {need}")
            raise DatasetFormatError(
                f"{self.bin_file}: the file {what}, but its index {self.idx_file.name} counts {self.num_tokens} "
                f"tokens of {self.dtype.name} in {len(self.sequence_lengths)} sequences, {need} bytes: the .bin "
                f"must be exactly that size (a truncated .bin, or an .idx of another .bin)")
        self.tokens = (np.memmap(self.bin_file, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                       if self.num_tokens else np.zeros(0, self.dtype))

    def _read_index(self) -> None:
        f = self.idx_file
        raw = f.read_bytes()
        if raw[:len(MAGIC)] != MAGIC:
            raise DatasetFormatError(f"{f}: bytes [0, 9) are {raw[:9]!r}: a Megatron index starts with {MAGIC!r}")
        if len(raw) < _HEADER.size:
            raise DatasetFormatError(f"{f}: truncated at byte offset {len(raw)}: the Megatron header is "
                                     f"{_HEADER.size} bytes")
        _, version, code, seq_count, doc_count = _HEADER.unpack_from(raw)
        if version != VERSION:
            raise DatasetFormatError(f"{f}: version {version} at byte offset 9: this reader knows "
                                     f"Megatron index version {VERSION}")
        if code not in DTYPES:
            raise DatasetFormatError(f"{f}: dtype code {code} at byte offset 17 is not one Megatron defines "
                                     f"({', '.join(f'{c} {d.name}' for c, d in DTYPES.items())})")
        self.dtype = DTYPES[code]
        need = _HEADER.size + 4 * seq_count + 8 * seq_count + 8 * doc_count
        # Multimodal indexes carry one more int8 per sequence after the document indices.
        if len(raw) not in (need, need + seq_count):
            raise DatasetFormatError(f"{f}: {len(raw)} bytes, but {seq_count} sequences and {doc_count} "
                                     f"document indices need {need} (the index is truncated or damaged)")
        o = _HEADER.size
        lengths = np.frombuffer(raw, "<i4", seq_count, o).astype(np.int64)
        pointers = np.frombuffer(raw, "<i8", seq_count, o + 4 * seq_count)
        doc_idx = np.frombuffer(raw, "<i8", doc_count, o + 12 * seq_count)
        if (lengths < 0).any():
            s = int(np.flatnonzero(lengths < 0)[0])
            raise DatasetFormatError(f"{f}: sequence {s} has length {lengths[s]} (at byte offset {o + 4 * s}): "
                                     f"lengths must be >= 0")
        # The token stream view needs sequences back to back, as Megatron's builder writes them.
        expected = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * self.dtype.itemsize if seq_count else lengths
        if (pointers != expected).any():
            s = int(np.flatnonzero(pointers != expected)[0])
            raise DatasetFormatError(f"{f}: sequence {s} starts at byte {pointers[s]} of the .bin (index byte "
                                     f"offset {o + 4 * seq_count + 8 * s}), expected {expected[s]}: sequences "
                                     f"must follow each other in the .bin")
        if doc_count < 1 or doc_idx[0] != 0 or doc_idx[-1] != seq_count or (np.diff(doc_idx) < 0).any():
            raise DatasetFormatError(f"{f}: the document indices (at byte offset {o + 12 * seq_count}) must rise "
                                     f"from 0 to the sequence count {seq_count}")
        seq_starts = np.concatenate([[0], np.cumsum(lengths)])  # token offsets, [seq_count+1]
        self.offsets = seq_starts[doc_idx]  # token offset of each document, [docs+1]
        self.lengths = np.diff(self.offsets)
        self.num_docs = len(self.lengths)
        self.sequence_lengths = lengths


class MegatronDatasetWriter(PrefixWriter):
    """Streams documents (one sequence each, already ending with eod, as
    preprocess_data.py's ``--append-eod`` makes them) into a Megatron dataset; nothing
    sits under the final names until ``finish()`` (:class:`PrefixWriter`)."""

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, eod_id: int):
        super().__init__(prefix, vocab_size, eod_id)
        self.dtype = megatron_token_dtype(vocab_size)
        self._lengths = array("q")  # 8 bytes a document until finish()
        self.num_tokens = 0

    @property
    def num_docs(self) -> int:
        return len(self._lengths)

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        arr = self._checked_document(ids)
        if arr.size >= 1 << 31:
            raise ValueError(f"document {self.num_docs} has {arr.size} tokens: Megatron stores lengths as int32")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def finish(self) -> Path:
        self._bin.close()
        n = self.num_docs
        lengths = np.frombuffer(self._lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * self.dtype.itemsize if n else lengths
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODES[self.dtype], n, n + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())
        return self._publish()
