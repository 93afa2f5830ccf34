"""Hugging Face ``datasets`` folders (written by ``Dataset.save_to_disk``) and Parquet
files, read with pyarrow (no ``datasets`` import needed).

A row is a document. With an ``input_ids`` column (a list of token ids per row) the
corpus is already tokenized and is read in place: a saved folder's Arrow files are
memory-mapped, Parquet (compressed, so not mappable) is decoded into memory once. The
end-of-document id is appended after every row, as ``moe-fold data`` does for text and
Megatron-LM's ``--append-eod`` does. Without ``input_ids`` the text column
(``data.text_key``) is tokenized like any text input (:mod:`moe_fold.data.corpus`).

pyarrow is an optional dependency (``pip install moe-fold[data]``), imported only here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from moe_fold.data.indexed_dataset import DatasetFormatError

TOKENS_COLUMN = "input_ids"


def pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401  (registers pa.parquet)
    except ImportError as e:
        raise ImportError("reading Hugging Face datasets and Parquet needs pyarrow: pip install 'moe-fold[data]' "
                          "(or pip install pyarrow)") from e
    return pa


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def is_parquet(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".parquet") or (path.is_dir() and any(path.glob("*.parquet")))


def data_files(path: Path) -> list[Path]:
    """The Arrow files of a saved dataset (in its own order), or the Parquet file(s) of ``path``."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetFormatError(f"{path}: a DatasetDict (splits {', '.join(splits)}): give one split's folder, "
                                 f"e.g. {path / (splits[0] if splits else 'train')}")
    if (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state.get("_data_files", [])]
        if not files:  # what save_to_disk writes for 0 rows
            raise DatasetFormatError(f"{path}: empty dataset: 0 tokens (its state.json lists no Arrow file)")
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise DatasetFormatError(f"{path / 'state.json'}: lists {missing[0].name}, which is missing: a saved "
                                     f"dataset needs all its Arrow files")
        return files
    if path.is_file():
        return [path]
    return sorted(path.glob("*.parquet"))


def _table(files: list[Path], columns: list[str] | None):
    """One pyarrow Table over ``files`` (Arrow IPC streams memory-mapped, or Parquet)."""
    pa = pyarrow()
    tables = []
    for f in files:
        try:
            if f.suffix == ".parquet":
                tables.append(pa.parquet.read_table(f, columns=columns, memory_map=True))
            else:
                t = pa.ipc.open_stream(pa.memory_map(str(f))).read_all()
                tables.append(t.select(columns) if columns else t)
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetFormatError(f"{f}: not a readable {'Parquet' if f.suffix == '.parquet' else 'Arrow'} "
                                     f"file ({e})") from e
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def column_names(files: list[Path]) -> list[str]:
    pa = pyarrow()
    f = files[0]
    try:
        if f.suffix == ".parquet":
            return pa.parquet.read_schema(f).names
        return pa.ipc.open_stream(pa.memory_map(str(f))).schema.names
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetFormatError(f"{f}: not a readable Arrow/Parquet file ({e})") from e


def iter_text_rows(path: Path, text_key: str) -> Iterator[str]:
    """The ``text_key`` strings of one Arrow or Parquet file, a record batch at a time."""
    pa = pyarrow()
    if path.suffix == ".parquet":
        batches = pa.parquet.ParquetFile(path).iter_batches(columns=[text_key])
    else:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
        if text_key not in reader.schema.names:
            raise ValueError(f"{path}: no column '{text_key}' (columns {', '.join(reader.schema.names)}; "
                             f"set data.text_key / --text-key)")
        batches = (b.select([text_key]) for b in reader)
    for batch in batches:
        col = batch.column(0)
        if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
            raise ValueError(f"{path}: column '{text_key}' holds {col.type}, not text")
        for text in col.to_pylist():
            yield text or ""


class ArrowTokens:
    """A pre-tokenized dataset: rows of ``input_ids``, each followed by ``eod_id``.
    ``tokens[a:b]`` reads that range of the document stream (rows and eods)."""

    def __init__(self, path: str | os.PathLike, eod_id: int):
        pa = pyarrow()
        self.prefix = Path(path)
        self.format = "hf-parquet" if is_parquet(self.prefix) else "hf-arrow"
        self.eod_id, self.vocab_size = eod_id, None
        files = data_files(self.prefix)
        names = column_names(files)
        if TOKENS_COLUMN not in names:
            raise DatasetFormatError(f"{self.prefix}: no '{TOKENS_COLUMN}' column (columns {', '.join(names)})")
        column = _table(files, [TOKENS_COLUMN]).column(0)
        self._values, self._row_offsets, first_row = [], [], [0]
        for chunk in column.chunks:
            if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)) \
                    or not pa.types.is_integer(chunk.type.value_type):
                raise DatasetFormatError(f"{self.prefix}: column '{TOKENS_COLUMN}' holds {chunk.type}: it must be "
                                         f"a list of integer token ids per row")
            if chunk.null_count:
                raise DatasetFormatError(f"{self.prefix}: column '{TOKENS_COLUMN}' has {chunk.null_count} empty "
                                         f"(null) rows")
            # A sliced chunk's offsets are sliced, its values are not: offsets index values as they are.
            offsets = chunk.offsets.to_numpy().astype(np.int64)
            values = chunk.values.to_numpy(zero_copy_only=False)
            self._values.append(values)
            self._row_offsets.append(offsets)
            first_row.append(first_row[-1] + len(chunk))
        self._first_row = np.asarray(first_row, np.int64)
        lengths = np.concatenate([np.diff(o) for o in self._row_offsets] or [np.zeros(0, np.int64)]) + 1
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.lengths = lengths
        self.num_docs = len(lengths)
        self.num_tokens = int(self.offsets[-1])
        self.dtype = self._values[0].dtype if self._values else np.dtype(np.int64)
        self.tokens = _DocumentStream(self)

    def row_values(self, d: int) -> np.ndarray:
        """The ids of row ``d`` (without the appended eod)."""
        c = int(np.searchsorted(self._first_row, d, side="right")) - 1
        local = d - self._first_row[c]
        o = self._row_offsets[c]
        return self._values[c][o[local]:o[local + 1]]

    def __len__(self) -> int:
        return self.num_docs

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range for {self.num_docs} documents in {self.prefix}")
        return self.tokens[self.offsets[i % self.num_docs]:self.offsets[i % self.num_docs + 1]]


class _DocumentStream:
    """Slices of the concatenation ``row 0, eod, row 1, eod, ...`` without building it."""

    def __init__(self, owner: ArrowTokens):
        self._owner = owner
        self.dtype = np.dtype(np.int64)

    def __len__(self) -> int:
        return self._owner.num_tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("a document stream is read by slices")
        o = self._owner
        a, b, step = key.indices(o.num_tokens)
        if step != 1:
            raise ValueError("a document stream is read by contiguous slices")
        out = np.empty(max(b - a, 0), np.int64)  # [b-a]
        pos, d = 0, int(np.searchsorted(o.offsets, a, side="right")) - 1
        while pos < len(out):
            start = int(o.offsets[d])
            values = o.row_values(d)
            lo, hi = a + pos - start, min(b - start, len(values) + 1)  # this row's part, eod at len(values)
            if lo < len(values):
                n = min(hi, len(values)) - lo
                out[pos:pos + n] = values[lo:lo + n]
                pos += n
            if hi == len(values) + 1:
                out[pos] = o.eod_id
                pos += 1
            d += 1
        return out
