"""Where training tokens come from: the built-in demo corpus, or ``data.path``.

The demo corpus is the Python standard library's own ``.py`` source: it is on every
machine that runs moe-fold, so the quick start trains without a download. Text given as
``data.path`` is tokenized once into ``data.cache_dir``; later runs reuse the result,
keyed by a hash of the file list (paths, sizes, modification times) and the tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterable

from moe_fold.data.documents import DEFAULT_EXTENSIONS, find_input_files
from moe_fold.data.indexed_dataset import dataset_exists
from moe_fold.data.preprocess import build_dataset
from moe_fold.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

DEMO_MAX_BYTES = 8 << 20
# Third-party packages installed into the interpreter are not the standard library.
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def demo_corpus_files(max_bytes: int = DEMO_MAX_BYTES) -> list[Path]:
    """The standard library's ``.py`` files in sorted path order, as many as fit in
    ``max_bytes`` (at least one), so every machine with the same Python gets the same list."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1")
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_STDLIB)
        for name in sorted(n for n in filenames if n.endswith(".py")):
            path = Path(dirpath) / name
            size = path.stat().st_size
            if files and total + size > max_bytes:
                return files
            files.append(path)
            total += size
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    return files


def _cache_key(kind: str, files: list[Path], tokenizer: Tokenizer, text_key: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{kind}\0{text_key}\0".encode())
    h.update(tokenizer.path.read_bytes() if isinstance(tokenizer, HFTokenizer) else tokenizer.spec.encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _ensure(kind: str, files: list[Path], cache_dir: str | os.PathLike, tokenizer: str,
            text_key: str = "text", progress: bool = False) -> Path:
    tok = load_tokenizer(tokenizer)
    prefix = Path(cache_dir) / f"{kind}-{_cache_key(kind, files, tok, text_key)}"
    if not dataset_exists(prefix):
        # Concurrent builders (several ranks) each write their own temporary files and
        # rename complete ones into place, so the result is whole whoever finishes last.
        build_dataset(files, tok, prefix, text_key=text_key, progress=progress)
    return prefix


def ensure_demo_dataset(cache_dir: str | os.PathLike, tokenizer: str = "byte",
                        max_bytes: int = DEMO_MAX_BYTES, progress: bool = False) -> Path:
    """The demo corpus as a dataset prefix under ``cache_dir``, built on first use."""
    return _ensure("demo", demo_corpus_files(max_bytes), cache_dir, tokenizer, progress=progress)


def prepare_data_paths(path: str | list[str] | None, tokenizer: str, cache_dir: str | os.PathLike,
                       text_key: str = "text", extensions: Iterable[str] = DEFAULT_EXTENSIONS,
                       progress: bool = False) -> list[Path]:
    """What to open for each ``data.path`` entry: None is the demo corpus; a tokenized
    dataset of any format :mod:`moe_fold.data.sources` reads is used in place; text (files,
    folders, JSONL, the text column of a Hugging Face dataset or Parquet) is tokenized into
    ``cache_dir``. In a multi-rank run call it on one rank first, then barrier, so the
    others find the cache built."""
    from moe_fold.data.sources import TOKEN_FORMATS, detect_format

    if path is None:
        return [ensure_demo_dataset(cache_dir, tokenizer, progress=progress)]
    prefixes = []
    for entry in [path] if isinstance(path, str) else path:
        fmt, where = detect_format(entry)
        if fmt in TOKEN_FORMATS:
            prefixes.append(where)
        elif fmt == "hf-text":
            from moe_fold.data.hf_datasets import data_files

            prefixes.append(_ensure("text", data_files(where), cache_dir, tokenizer, text_key, progress))
        else:
            files = find_input_files([entry], extensions)
            prefixes.append(_ensure("text", files, cache_dir, tokenizer, text_key, progress))
    return prefixes
