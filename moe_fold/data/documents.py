"""Finding input files and reading documents out of them.

A plain text file is one document. A JSONL file holds one document per line, the text
under a key (``text`` by default), and may be compressed (``.jsonl.gz``, ``.jsonl.zst``:
read as a stream, never whole). A Parquet or Arrow file holds one document per row, the
text in the column of that name. Files are read as UTF-8; bytes that are not valid
UTF-8 become U+FFFD so one bad byte cannot stop a long preprocessing run, and so do
lone surrogates that JSON escapes (``"\\ud800"``) can produce, which no tokenizer encodes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

# Extensions picked up when a folder is given; a file named explicitly is always read.
DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".jsonl", ".jsonl.gz", ".jsonl.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLE_SUFFIXES = (".parquet", ".arrow")


def find_input_files(inputs: Iterable[str | os.PathLike], extensions: Iterable[str] = DEFAULT_EXTENSIONS) -> list[Path]:
    """Files named in ``inputs`` plus, for each folder, its files (recursively) whose
    extension is in ``extensions``. Each folder's files are sorted so the result, and so
    the dataset built from it, is the same on every machine."""
    exts = tuple(e if e.startswith(".") else f".{e}" for e in extensions)
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(exts))
            if not found:
                raise ValueError(f"input folder {path} holds no files ending in {', '.join(exts)}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} is neither a file nor a folder")
    if not files:
        raise ValueError("no input files given")
    return files


def is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def open_binary_stream(raw: BinaryIO, path: Path) -> BinaryIO:
    """``raw`` decompressed by its file name's suffix, as a buffered stream of lines."""
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if path.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise ImportError(f"{path}: reading .zst needs zstandard: pip install 'moe-fold[data]' "
                              f"(or pip install zstandard)") from e
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def parse_jsonl_line(line: bytes, path: Path, line_no: int, text_key: str) -> str | None:
    """The text of one JSONL line; None for a blank line. Errors name the file and line."""
    if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]  # a byte-order mark before the first record is not JSON
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
    if not isinstance(record, dict) or text_key not in record:
        raise ValueError(f"{path}:{line_no}: JSONL record has no '{text_key}' field "
                         f"(set the key with --text-key)")
    text = record[text_key]
    if not isinstance(text, str):
        raise ValueError(f"{path}:{line_no}: field '{text_key}' must be a string, "
                         f"got {type(text).__name__}")
    return without_lone_surrogates(text)


def iter_file_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """The documents of one file: the whole text, one per non-empty JSONL line, or one per
    row of a Parquet/Arrow file."""
    if path.name.endswith(TABLE_SUFFIXES):
        from moe_fold.data.hf_datasets import iter_text_rows

        yield from iter_text_rows(path, text_key)
        return
    if not is_jsonl(path):
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    with open(path, "rb") as raw:
        for line_no, line in enumerate(open_binary_stream(raw, path), 1):
            text = parse_jsonl_line(line, path, line_no, text_key)
            if text is not None:
                yield text


def without_lone_surrogates(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        # Through UTF-16 and back: each lone surrogate half becomes U+FFFD, the rest is unchanged.
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def iter_documents(files: Iterable[Path], text_key: str = "text") -> Iterator[str]:
    for path in files:
        yield from iter_file_documents(Path(path), text_key)
