"""Every tokenized format ``data.path`` may name, told apart by the path, opened behind
one reading interface, and checked before any rank starts.

=============  =====================================================  ===================
format         a ``data.path`` entry                                  reader
=============  =====================================================  ===================
moefidx        ``PREFIX`` (or ``.bin``/``.idx``), magic ``MOEFIDX``   IndexedDataset
megatron       ``PREFIX`` (or ``.bin``/``.idx``), magic ``MMIDIDX``   MegatronDataset
npy            ``tokens.npy`` (OLMo/Dolma)                            FlatTokens
raw            ``train.bin`` with no ``.idx`` (nanoGPT), data.dtype   FlatTokens
hf-arrow       a ``save_to_disk`` folder with ``input_ids``           ArrowTokens
hf-parquet     ``.parquet`` file or folder with ``input_ids``         ArrowTokens
hf-text        either of the two above with a text column             tokenized (corpus)
text           text/JSONL files or folders                            tokenized (corpus)
=============  =====================================================  ===================

A reader has ``tokens`` (every token, sliced by ranges), ``offsets``/``lengths`` (per
document), ``num_tokens``, ``num_docs``, ``eod_id``, ``vocab_size`` (None when the
format does not store it), ``format`` and ``prefix`` (the path, for messages).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from moe_fold.config import choice, require
from moe_fold.data.indexed_dataset import MAGIC as MOEFIDX_MAGIC
from moe_fold.data.indexed_dataset import DatasetFormatError, IndexedDataset, idx_path
from moe_fold.data.megatron_dataset import MAGIC as MEGATRON_MAGIC
from moe_fold.data.megatron_dataset import MegatronDataset

TOKEN_FORMATS = ("moefidx", "megatron", "npy", "raw", "hf-arrow", "hf-parquet")
CHECK_BLOCK = 1 << 20  # tokens per block of the vocabulary check


def detect_format(entry: str | os.PathLike) -> tuple[str, Path]:
    """``(format, path)`` of a ``data.path`` entry (see the table above); the path is the
    prefix for the indexed formats."""
    from moe_fold.data import hf_datasets

    entry = str(entry)
    stem = entry[:-4] if entry.endswith((".bin", ".idx")) else entry
    index = idx_path(stem)
    if index.is_file():
        with open(index, "rb") as f:
            magic = f.read(len(MEGATRON_MAGIC))
        if magic.startswith(MOEFIDX_MAGIC):
            return "moefidx", Path(stem)
        if magic == MEGATRON_MAGIC:
            return "megatron", Path(stem)
        raise DatasetFormatError(f"{index}: bytes [0, 9) are {magic!r}: an index file starts with "
                                 f"{MOEFIDX_MAGIC!r} (moe-fold) or {MEGATRON_MAGIC!r} (Megatron-LM)")
    path = Path(entry)
    if path.is_file() and path.suffix == ".npy":
        return "npy", path
    if path.is_file() and path.suffix == ".bin":
        return "raw", path
    if hf_datasets.is_saved_dataset(path) or hf_datasets.is_parquet(path):
        kind = "parquet" if hf_datasets.is_parquet(path) else "arrow"
        names = hf_datasets.column_names(hf_datasets.data_files(path))
        return (f"hf-{kind}" if hf_datasets.TOKENS_COLUMN in names else "hf-text"), path
    if path.exists():
        return "text", path
    raise FileNotFoundError(f"data.path entry {entry!r} is neither a dataset prefix ({stem}.bin/.idx) nor a "
                            f"token file, Hugging Face dataset, text file or folder")


def open_tokens(entry: str | os.PathLike, eod_id: Optional[int], dtype: Optional[str] = None,
                verify: str = "sampled"):
    """The reader of a tokenized ``data.path`` entry. ``eod_id`` is the end-of-document id
    of formats that do not store one; ``dtype`` the token dtype of a raw ``.bin``."""
    from moe_fold.data.flat_tokens import FlatTokens

    fmt, path = detect_format(entry)
    if fmt == "moefidx":
        return IndexedDataset(path, verify=verify)
    if eod_id is None:
        raise ValueError(f"{path}: a {fmt} dataset stores no end-of-document id: set data.eod_id "
                         f"(or data.tokenizer)")
    if fmt == "megatron":
        return MegatronDataset(path, eod_id)
    if fmt in ("npy", "raw"):
        return FlatTokens(path, eod_id, dtype)
    if fmt in ("hf-arrow", "hf-parquet"):
        from moe_fold.data.hf_datasets import ArrowTokens

        return ArrowTokens(path, eod_id)
    raise ValueError(f"data.path entry {str(entry)!r} is {fmt}, which is tokenized first (prepare_data_paths)")


def token_location(source, offset: int) -> str:
    """Where token ``offset`` of the stream lies, in the terms of the source's files."""
    if source.format in ("hf-arrow", "hf-parquet"):
        row = int(np.searchsorted(source.offsets, offset, side="right")) - 1
        return f"row {row}, position {offset - int(source.offsets[row])} (token offset {offset})"
    return f"token offset {offset} (byte offset {offset * source.dtype.itemsize})"


def data_file(source) -> Path:
    return getattr(source, "bin_file", source.prefix)


def check_tokens(source, vocab_size: int, verify: str = "sampled", blocks: int = 8) -> None:
    """Raise ``DatasetFormatError`` at the first token id outside ``[0, vocab_size)`` (or,
    in a float file, not a whole number). ``sampled`` reads ``blocks`` blocks of 2^20
    tokens (the first, the last, evenly spaced ones between): a corpus made with another
    tokenizer shows at once; ``full`` reads every token. The loader checks every sample
    it reads as well (:class:`moe_fold.data.loader.GPTDataset`)."""
    require(choice, "data.verify", verify)
    for b in checked_blocks(source.num_tokens, verify == "full", blocks):
        start = b * CHECK_BLOCK
        block = np.asarray(source.tokens[start:start + CHECK_BLOCK])
        check_block(source, block, start, vocab_size)


def checked_blocks(num_tokens: int, full: bool, count: int = 8) -> list[int]:
    """Which blocks of ``CHECK_BLOCK`` tokens a check reads: all, or ``count`` of them (the
    first, the last and evenly spaced ones between)."""
    n = -(-num_tokens // CHECK_BLOCK)
    if full or n <= count:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, count).round().astype(int).tolist()))


def check_block(source, block: np.ndarray, start: int, vocab_size: int) -> None:
    """The vocabulary rule on ``block``, tokens ``[start, start + len(block))`` of ``source``."""
    bad = (block < 0) | (block >= vocab_size)
    if block.dtype.kind == "f":
        bad |= block != np.round(block)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DatasetFormatError(f"{data_file(source)}: token id {block[i]} at {token_location(source, start + i)} "
                                 f"is outside the vocabulary: ids must be whole numbers in "
                                 f"[0, model.vocab_size={vocab_size})")


def check_source(source, vocab_size: int, min_tokens: int, verify: str = "sampled") -> None:
    """Everything the loader will need of one opened source: not empty, enough tokens for
    one sample, a stored vocabulary that fits the model's, ids inside it."""
    f = data_file(source)
    if source.num_tokens == 0:
        raise DatasetFormatError(f"{f}: empty dataset: 0 tokens at byte offset 0; a training dataset needs at "
                                 f"least model.seq_length+1={min_tokens} tokens")
    if source.num_tokens < min_tokens:
        raise DatasetFormatError(f"{f}: {source.num_tokens} tokens end at {token_location(source, source.num_tokens)}"
                                 f"; a training dataset needs at least model.seq_length+1={min_tokens} tokens")
    if source.vocab_size is not None and source.vocab_size > vocab_size:
        raise DatasetFormatError(f"{f}: was tokenized with vocab_size={source.vocab_size}, larger than "
                                 f"model.vocab_size={vocab_size}")
    check_tokens(source, vocab_size, verify)


def resolved_eod_id(data_config) -> int:
    """``data.eod_id``, or the end-of-document id of ``data.tokenizer``."""
    from moe_fold.data.tokenizer import load_tokenizer

    return data_config.eod_id if data_config.eod_id is not None else load_tokenizer(data_config.tokenizer).eod_id


def check_data(config) -> None:
    """Open and check every tokenized dataset of ``data.path`` and ``data.valid_path``
    (headers, sizes, emptiness, vocabulary) in this process, so a bad file fails before
    any rank starts. Text inputs are checked as they are tokenized."""
    from moe_fold.config import data_paths

    d = config.data
    entries = data_paths(config) + ([d.valid_path] if d.valid_path else [])
    eod = None
    for entry in entries:
        fmt, _ = detect_format(entry)
        if fmt not in TOKEN_FORMATS:
            continue
        eod = resolved_eod_id(d) if eod is None else eod
        source = open_tokens(entry, eod, d.dtype, d.verify)
        check_source(source, config.model.vocab_size, config.model.seq_length + 1, d.verify)
