"""The same byte-tokenized corpus in every data format moe-fold reads (ours, Megatron's
MMIDIDX written from its published layout, .npy, nanoGPT's raw .bin, Hugging Face Arrow and
Parquet), for the tests of tests/data/ and tests/cli/test_data.py."""

import struct
from pathlib import Path

import numpy as np

from moe_fold.data.indexed_dataset import IndexedDataset, write_indexed_dataset

EOD = 256
CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


def corpus_texts(n: int = 40) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["moe", "fold", "expert", "router", "token", "naïve", "日本", "grad", "all-to-all", "😀"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) + f" #{i}" for i in range(n)]


def corpus_docs(texts=None) -> list[list[int]]:
    """Byte-tokenized documents, each ending with eod (as every format here stores them)."""
    return [list(t.encode()) + [EOD] for t in (texts or corpus_texts())]


def megatron_from_spec(prefix: Path, sequences: list[list[int]], code: int,
                       doc_starts: list[int] | None = None) -> Path:
    """Megatron's .bin/.idx written straight from the published layout."""
    dtype = np.dtype(CODES[code]).newbyteorder("<")
    n = len(sequences)
    doc_idx = list(range(n + 1)) if doc_starts is None else doc_starts
    pointers, at = [], 0
    for s in sequences:
        pointers.append(at)
        at += len(s) * dtype.itemsize
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", n)
           + struct.pack("<Q", len(doc_idx)) + struct.pack(f"<{n}i", *map(len, sequences))
           + struct.pack(f"<{n}q", *pointers) + struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in sequences))
    return prefix


def write_all_formats(folder: Path, docs: list[list[int]]) -> dict[str, str]:
    """The same documents in every format; returns format -> data.path entry."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"moefidx": str(write_indexed_dataset(folder / "moefidx", docs, 258, EOD)),
             "megatron": str(megatron_from_spec(folder / "megatron", docs, 8))}
    np.save(folder / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    paths["npy"] = str(folder / "tokens.npy")
    np.concatenate(docs).astype(np.uint16).tofile(folder / "train.bin")  # nanoGPT's raw file
    paths["raw"] = str(folder / "train.bin")
    rows = datasets.Dataset.from_dict({"input_ids": [d[:-1] for d in docs]})  # eod appended on reading
    rows.save_to_disk(str(folder / "hf"), num_shards=3)  # three Arrow files: rows cross chunk boundaries
    paths["hf-arrow"] = str(folder / "hf")
    rows.to_parquet(str(folder / "rows.parquet"), batch_size=16)  # row groups of 16
    paths["hf-parquet"] = str(folder / "rows.parquet")
    return paths


def write_corpus(folder: Path) -> list[str]:
    """Twenty small Python files of non-ASCII text in ``folder``; returns their texts in order."""
    texts = [f"def function_{i}(x):\n    return x * {i} + 'héllo wörld'\n" * 3 for i in range(20)]
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"f{i:02d}.py").write_text(t, encoding="utf-8")
    return texts


def docs_of(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix, verify="full")
    return [ds[i].tolist() for i in range(len(ds))]
