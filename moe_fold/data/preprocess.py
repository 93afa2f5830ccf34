"""Text -> indexed token dataset: read documents, tokenize, append end-of-document, write."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from moe_fold.data.documents import DEFAULT_EXTENSIONS, find_input_files, iter_file_documents
from moe_fold.data.indexed_dataset import IndexedDatasetWriter
from moe_fold.data.tokenizer import Tokenizer

# Documents are tokenized in groups so a Hugging Face tokenizer can use its threads.
_BATCH_DOCS = 256


@dataclass
class BuildSummary:
    prefix: Path
    files: int
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    skipped_empty: int


def build_dataset(inputs: Iterable[str | os.PathLike], tokenizer: Tokenizer,
                  output_prefix: str | os.PathLike, text_key: str = "text",
                  extensions: Iterable[str] = DEFAULT_EXTENSIONS, progress: bool = False) -> BuildSummary:
    """Tokenize every document of ``inputs`` (files, folders, JSONL) into
    ``output_prefix.bin/.idx``. Each document is followed by ``tokenizer.eod_id``;
    empty documents are skipped and counted. ``progress`` shows a bar over input bytes."""
    start = time.perf_counter()
    files = find_input_files(inputs, extensions)
    sizes = [f.stat().st_size for f in files]
    bar = _progress_bar(sum(sizes)) if progress else None
    try:
        documents, tokens, skipped = _write(files, sizes, tokenizer, output_prefix, text_key, bar)
    finally:
        if bar is not None:
            bar[0].stop()
    return BuildSummary(Path(output_prefix), len(files), documents, tokens, sum(sizes),
                        time.perf_counter() - start, skipped)


def _write(files: list[Path], sizes: list[int], tokenizer: Tokenizer,
           output_prefix: str | os.PathLike, text_key: str, bar) -> tuple[int, int, int]:
    eod = tokenizer.eod_id
    skipped = 0
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, eod) as writer:
        pending: list[str] = []

        def flush() -> None:
            for ids in tokenizer.encode_batch(pending):
                writer.add_document(np.concatenate([ids, [eod]]))
            pending.clear()

        for path, size in zip(files, sizes):
            for text in iter_file_documents(path, text_key):
                if not text:
                    skipped += 1
                    continue
                pending.append(text)
                if len(pending) >= _BATCH_DOCS:
                    flush()
            if bar is not None:
                bar[0].update(bar[1], advance=size)
        flush()
    return writer.num_docs, writer.num_tokens, skipped


def _progress_bar(total: int):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                        transient=True)
    task = progress.add_task("tokenizing", total=total)
    progress.start()
    return progress, task
