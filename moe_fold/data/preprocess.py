"""Text -> tokenized dataset: read documents, tokenize (in N processes), append
end-of-document, write moe-fold's format or Megatron-LM's.

The reading process streams the inputs (a JSONL line, a Parquet batch, a text file at a
time, never a whole compressed file) and cuts them into work units of at most
``_UNIT_DOCS`` documents and ``_UNIT_BYTES`` bytes. The cuts depend on the inputs alone,
and results are written in the order the units were read, so the output is the same
bytes for any number of workers (``tests/data/test_sources.py``). Workers parse the JSON
and tokenize (Hugging Face ``tokenizers`` batch encoding); at most ``2 * workers`` units
are in flight, so memory stays bounded whatever the corpus size.

The writer keeps everything under temporary names until the last document, then
renames: an interrupted job leaves nothing under the final name, and running it again
starts over cleanly.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from moe_fold.data.documents import (DEFAULT_EXTENSIONS, TABLE_SUFFIXES, find_input_files, is_jsonl,
                                     open_binary_stream, parse_jsonl_line)
from moe_fold.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from moe_fold.data.tokenizer import Tokenizer

# A work unit: enough documents for a Hugging Face tokenizer to batch, small enough to
# keep 2 * workers of them in memory.
_UNIT_DOCS = 256
_UNIT_BYTES = 1 << 20
FORMATS = ("moefidx", "megatron")


@dataclass
class BuildSummary:
    prefix: Path
    files: int
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    skipped_empty: int


@dataclass
class _Unit:
    """Documents to tokenize: raw JSONL lines (parsed by the worker, so errors can name
    ``path:line``) or texts already read."""
    path: Path
    first_line: int
    lines: list[bytes] | None = None
    texts: list[str] | None = None


def build_dataset(inputs: Iterable[str | os.PathLike], tokenizer: Tokenizer,
                  output_prefix: str | os.PathLike, text_key: str = "text",
                  extensions: Iterable[str] = DEFAULT_EXTENSIONS, progress: bool = False,
                  workers: int = 1, output_format: str = "moefidx") -> BuildSummary:
    """Tokenize every document of ``inputs`` (files, folders, JSONL, compressed JSONL,
    Parquet/Arrow text) into ``output_prefix.bin/.idx`` in ``output_format`` (moe-fold's
    ``moefidx`` or ``megatron``) with ``workers`` processes. Each document is followed
    by ``tokenizer.eod_id``; empty documents are skipped and counted; no document at all
    is an error. ``progress`` shows a bar over input bytes with MB/s and an ETA."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    if output_format not in FORMATS:
        raise ValueError(f"format={output_format!r} must be one of {', '.join(FORMATS)}")
    start = time.perf_counter()
    files = find_input_files(inputs, extensions)
    sizes = [f.stat().st_size for f in files]
    bar = _ProgressBar(sum(sizes)) if progress else None
    try:
        documents, tokens, skipped = _write(files, tokenizer, output_prefix, text_key, workers, output_format, bar)
    finally:
        if bar is not None:
            bar.stop()
    return BuildSummary(Path(output_prefix), len(files), documents, tokens, sum(sizes),
                        time.perf_counter() - start, skipped)


def _units(files: list[Path], text_key: str) -> Iterator[tuple[_Unit, int]]:
    """(unit, input bytes read so far) in input order."""
    done = 0
    for path in files:
        size = path.stat().st_size
        if is_jsonl(path):
            with open(path, "rb") as raw:
                unit, nbytes = _Unit(path, 1, lines=[]), 0
                for line_no, line in enumerate(open_binary_stream(raw, path), 1):
                    unit.lines.append(line)
                    nbytes += len(line)
                    if len(unit.lines) >= _UNIT_DOCS or nbytes >= _UNIT_BYTES:
                        yield unit, done + min(raw.tell(), size)
                        unit, nbytes = _Unit(path, line_no + 1, lines=[]), 0
                if unit.lines:
                    yield unit, done + size
        elif path.name.endswith(TABLE_SUFFIXES):
            from moe_fold.data.hf_datasets import iter_text_rows

            unit, nbytes = _Unit(path, 1, texts=[]), 0
            for text in iter_text_rows(path, text_key):
                unit.texts.append(text)
                nbytes += len(text)
                if len(unit.texts) >= _UNIT_DOCS or nbytes >= _UNIT_BYTES:
                    yield unit, done
                    unit, nbytes = _Unit(path, 1, texts=[]), 0
            if unit.texts:
                yield unit, done + size
        else:
            yield _Unit(path, 1, texts=[path.read_text(encoding="utf-8", errors="replace")]), done + size
        done += size


# The tokenizer of a worker process, loaded once by _init_worker.
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str, threads: int) -> None:
    global _WORKER_TOKENIZER
    # Environment: each worker gets its share of the cores for tokenizers' own (Rayon)
    # threads, which Rayon reads on first use.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    from moe_fold.data.tokenizer import load_tokenizer

    _WORKER_TOKENIZER = load_tokenizer(spec)


def _encode(unit: _Unit, text_key: str, tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens of the unit's non-empty documents, each followed by eod, [n]; their
    lengths, [docs]; empty documents skipped)."""
    tok = tokenizer or _WORKER_TOKENIZER
    if unit.lines is not None:
        texts = [parse_jsonl_line(line, unit.path, unit.first_line + i, text_key) for i, line in enumerate(unit.lines)]
        texts = [t for t in texts if t is not None]
    else:
        texts = unit.texts
    kept = [t for t in texts if t]
    encoded = tok.encode_batch(kept) if kept else []
    lengths = np.asarray([len(ids) + 1 for ids in encoded], np.int64)
    # The dtype the dataset stores: half or a quarter of int64's bytes to send back.
    tokens = np.empty(int(lengths.sum()), token_dtype(tok.vocab_size))
    ends = np.cumsum(lengths)
    for ids, end in zip(encoded, ends):
        tokens[end - len(ids) - 1:end - 1] = ids
        tokens[end - 1] = tok.eod_id
    return tokens, lengths, len(texts) - len(kept)


def _encoded(units: Iterator[tuple[_Unit, int]], tokenizer: Tokenizer, text_key: str, workers: int):
    """(tokens, lengths, skipped, bytes read) per unit, in input order."""
    if workers == 1:
        for unit, done in units:
            yield (*_encode(unit, text_key, tokenizer), done)
        return
    import multiprocessing

    # spawn: a fresh interpreter per worker, safe whatever threads this process runs.
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec, threads)) as pool:
        pending: deque = deque()
        for unit, done in units:
            pending.append((pool.apply_async(_encode, (unit, text_key)), done))
            if len(pending) >= 2 * workers:
                result, d = pending.popleft()
                yield (*result.get(), d)
        while pending:
            result, d = pending.popleft()
            yield (*result.get(), d)


def _writer(output_format: str, prefix, tokenizer: Tokenizer):
    if output_format == "megatron":
        from moe_fold.data.megatron_dataset import MegatronDatasetWriter

        return MegatronDatasetWriter(prefix, tokenizer.vocab_size, tokenizer.eod_id)
    return IndexedDatasetWriter(prefix, tokenizer.vocab_size, tokenizer.eod_id)


def _write(files: list[Path], tokenizer: Tokenizer, output_prefix, text_key: str, workers: int,
           output_format: str, bar) -> tuple[int, int, int]:
    skipped = 0
    with _writer(output_format, output_prefix, tokenizer) as writer:
        for tokens, lengths, empty, done in _encoded(_units(files, text_key), tokenizer, text_key, workers):
            skipped += empty
            start = 0
            for n in lengths.tolist():
                writer.add_document(tokens[start:start + n])
                start += n
            if bar is not None:
                bar.update(done)
        if writer.num_docs == 0:
            shown = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
            raise ValueError(f"empty dataset: the {len(files)} input files ({shown}) hold no non-empty "
                             f"document ({skipped} empty ones); nothing written to {output_prefix}")
    return writer.num_docs, writer.num_tokens, skipped


class _ProgressBar:
    """A rich bar over input bytes: done/total, MB/s, time left."""

    def __init__(self, total: int):
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._progress = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                  TimeRemainingColumn(), transient=True)
        self._task = self._progress.add_task("tokenizing", total=total)
        self._progress.start()

    def update(self, done: int) -> None:
        self._progress.update(self._task, completed=done)

    def stop(self) -> None:
        self._progress.stop()
