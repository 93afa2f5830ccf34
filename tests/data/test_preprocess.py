"""Tokenizers, the indexed dataset format and its errors, preprocessing, and the demo corpus
(the command `moe-fold data`: tests/cli/test_data.py)."""

from __future__ import annotations

import json
import os
import re
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from moe_fold.data.corpus import demo_corpus_files, ensure_demo_dataset, prepare_data_paths
from moe_fold.data.documents import find_input_files
from moe_fold.data.indexed_dataset import (DatasetFormatError, IndexedDataset, IndexedDatasetWriter,
                                           write_indexed_dataset)
from moe_fold.data.preprocess import build_dataset
from moe_fold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

TRICKY = "naïve café 日本語 😀\r\n\ttabs  and\x00nul € \u200b end"


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode(TRICKY)
    assert ids == list(TRICKY.encode("utf-8"))
    assert tok.decode(ids) == TRICKY
    assert tok.decode(ids + [tok.eod_id]) == TRICKY  # special ids are not text
    assert (tok.vocab_size, tok.eod_id, tok.pad_id) == (258, 256, 257)
    # A slice that cuts the 4-byte emoji still decodes, with U+FFFD where the cut is.
    emoji = tok.encode("a😀b")
    assert tok.decode(emoji[:3]) == "a\ufffd"
    assert load_tokenizer("byte").encode("x") == [120]


def _write_corpus(folder: Path) -> list[str]:
    texts = [f"def function_{i}(x):\n    return x * {i} + 'héllo wörld'\n" * 3 for i in range(20)]
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"f{i:02d}.py").write_text(t, encoding="utf-8")
    return texts


def test_trained_bpe_round_trips_and_compresses(tmp_path):
    texts = _write_corpus(tmp_path / "src")
    tok = train_bpe([tmp_path / "src"], 400, tmp_path / "tok.json")
    assert (tmp_path / "tok.json").is_file()
    assert tok.vocab_size <= 400
    assert tok.eod_id == 0 and tok.pad_id == 1
    for t in texts + [TRICKY]:
        assert tok.decode(tok.encode(t)) == t
    # The merges learned on the corpus make it shorter than its bytes.
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    assert n_tokens < n_bytes / 2
    again = load_tokenizer(str(tmp_path / "tok.json"))
    assert again.encode(texts[0]) == tok.encode(texts[0])
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_bytes((tmp_path / "tok.json").read_bytes())
    assert load_tokenizer(str(tmp_path / "model")).encode(texts[1]) == tok.encode(texts[1])
    with pytest.raises(ValueError, match=r"BPE vocab_size=100 must be >= 258"):
        train_bpe([tmp_path / "src"], 100, tmp_path / "small.json")


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file .*missing.json not found"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{bad}: not a Hugging Face tokenizer.json")):
        HFTokenizer(bad)


def _docs_of(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix, verify="full")
    return [ds[i].tolist() for i in range(len(ds))]


def test_jsonl_and_folder_preprocess_exact_tokens(tmp_path):
    src = tmp_path / "in"
    (src / "deep" / "er").mkdir(parents=True)
    (src / "b.txt").write_text("second file\n")
    (src / "a.md").write_text("# first file ü")
    (src / "skip.bin").write_bytes(b"\xff\x00")  # not a text extension: ignored in a folder
    records = [{"body": "jsonl one"}, {"body": ""}, {"body": "jsonl two 日本"}]
    (src / "deep" / "er" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    tok = ByteTokenizer()
    summary = build_dataset([src], tok, tmp_path / "out" / "ds", text_key="body")
    expected_texts = ["# first file ü", "second file\n", "jsonl one", "jsonl two 日本"]  # sorted paths
    assert _docs_of(tmp_path / "out" / "ds") == [list(t.encode()) + [256] for t in expected_texts]
    assert (summary.files, summary.documents, summary.skipped_empty) == (3, 4, 1)
    assert summary.tokens == sum(len(t.encode()) + 1 for t in expected_texts)
    ds = IndexedDataset(tmp_path / "out" / "ds")
    assert ds.dtype == np.uint16 and ds.vocab_size == 258 and ds.eod_id == 256
    build_dataset([src], tok, tmp_path / "out" / "again", text_key="body", progress=True)
    for ext in ("bin", "idx"):  # the progress bar changes nothing in the output
        assert (tmp_path / "out" / f"again.{ext}").read_bytes() == (tmp_path / "out" / f"ds.{ext}").read_bytes()
    assert ByteTokenizer().decode(ds[3]) == "jsonl two 日本"


def test_jsonl_bom_and_escaped_surrogates(tmp_path):
    f = tmp_path / "odd.jsonl"
    # A byte-order mark, an escaped surrogate pair (one emoji) and a lone surrogate.
    f.write_bytes(b"\xef\xbb\xbf" + b'{"text": "pair \\ud83d\\ude00 lone \\ud800 end"}\n')
    build_dataset([f], ByteTokenizer(), tmp_path / "ds")
    assert ByteTokenizer().decode(_docs_of(tmp_path / "ds")[0]) == "pair \U0001F600 lone \ufffd end"


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: not valid JSON")):
        build_dataset([bad], ByteTokenizer(), tmp_path / "o")
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{nokey}:1: JSONL record has no 'text' field")):
        build_dataset([nokey], ByteTokenizer(), tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        find_input_files([tmp_path / "nothing"])
    assert not list(tmp_path.glob("o*")), "a failed build must leave no files"


def test_dtype_choice_and_id_range(tmp_path):
    big = write_indexed_dataset(tmp_path / "big", [[0, 69_999, 5]], vocab_size=70_000, eod_id=5)
    ds = IndexedDataset(big)
    assert ds.dtype == np.int32 and ds[0].tolist() == [0, 69_999, 5]
    assert IndexedDataset(write_indexed_dataset(tmp_path / "u16", [[65_535]], 65_536, 0)).dtype == np.uint16
    with pytest.raises(ValueError, match=r"document 1 has token ids in \[3, 300\], outside \[0, vocab_size=258\)"):
        write_indexed_dataset(tmp_path / "bad", [[1], [3, 300]], 258, 256)
    assert not (tmp_path / "bad.bin").exists() and not list(tmp_path.glob("bad*tmp*"))


def _make(tmp_path, name="ds", block_size=16):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n).tolist() + [256] for n in (5, 40, 17, 90, 3)]
    prefix = write_indexed_dataset(tmp_path / name, docs, 258, 256, block_size=block_size)
    return prefix, docs


def test_index_round_trip_and_offsets(tmp_path):
    prefix, docs = _make(tmp_path)
    ds = IndexedDataset(prefix, verify="full")
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.lengths.tolist() == [len(d) for d in docs]
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert isinstance(ds.tokens, np.memmap)
    with pytest.raises(IndexError):
        ds[5]


def test_corrupt_files_give_one_clear_error(tmp_path):
    prefix, docs = _make(tmp_path)
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    good_bin, good_idx = bin_file.read_bytes(), idx_file.read_bytes()
    n_bytes = 2 * sum(len(d) for d in docs)

    def expect(message: str):
        with pytest.raises(DatasetFormatError) as e:
            IndexedDataset(prefix)
        assert str(e.value) == message
        bin_file.write_bytes(good_bin)
        idx_file.write_bytes(good_idx)

    bin_file.write_bytes(good_bin[:-2])
    expect(f"{bin_file}: size mismatch: the file ends at byte offset {n_bytes - 2}, the index ds.idx says "
           f"{n_bytes} bytes ({n_bytes // 2} tokens of uint16): the .bin must be exactly that size")

    altered = bytearray(good_bin)
    altered[-1] ^= 0x01  # the last block is always checked
    bin_file.write_bytes(bytes(altered))
    last = (n_bytes - 1) // 16
    with pytest.raises(DatasetFormatError, match=re.escape(
            f"{bin_file}: checksum mismatch in bytes [{last * 16}, {n_bytes}) (block {last}): crc32 ")):
        IndexedDataset(prefix)
    bin_file.write_bytes(good_bin)

    idx_file.write_bytes(b"GARBAGE!" + good_idx[8:])
    expect(f"{idx_file}: bad magic b'GARBAGE!' at byte offset 0, expected b'MOEFIDX\\x00': not a moe-fold index file")

    idx_file.write_bytes(good_idx[:8] + struct.pack("<I", 2) + good_idx[12:])
    expect(f"{idx_file}: unsupported format version 2 at byte offset 8; this moe-fold reads version 1")

    idx_file.write_bytes(good_idx[:-8])
    expect(f"{idx_file}: size mismatch: {len(good_idx) - 8} bytes, the header implies {len(good_idx)} "
           f"(5 documents, {-(-n_bytes // 16)} blocks)")

    damaged = bytearray(good_idx)
    damaged[70] ^= 0x40  # inside the document offsets
    idx_file.write_bytes(bytes(damaged))
    with pytest.raises(DatasetFormatError, match=re.escape(f"{idx_file}: checksum mismatch: crc32 of the index")):
        IndexedDataset(prefix)
    idx_file.write_bytes(good_idx)

    os.remove(bin_file)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{bin_file}: dataset file not found")):
        IndexedDataset(prefix)


def test_sampled_check_versus_full(tmp_path):
    """Opening checks 8 of the blocks (first, last, evenly spaced); verify='full' checks all."""
    prefix, docs = _make(tmp_path, block_size=4)
    bin_file = Path(f"{prefix}.bin")
    n_blocks = -(-bin_file.stat().st_size // 4)
    checked = set(np.linspace(0, n_blocks - 1, 8).round().astype(int).tolist())
    unchecked = next(b for b in range(n_blocks) if b not in checked)
    data = bytearray(bin_file.read_bytes())
    data[unchecked * 4] ^= 0x01
    bin_file.write_bytes(bytes(data))
    IndexedDataset(prefix)  # the damaged block is not among the sampled ones
    with pytest.raises(DatasetFormatError, match=re.escape(f"(block {unchecked})")):
        IndexedDataset(prefix, verify="full")
    data[unchecked * 4] ^= 0x01
    data[0] ^= 0x01
    bin_file.write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match=re.escape("(block 0)")):
        IndexedDataset(prefix)


def test_writer_is_atomic(tmp_path):
    prefix, docs = _make(tmp_path)
    before = Path(f"{prefix}.bin").read_bytes()
    with pytest.raises(RuntimeError, match="crash"):
        with IndexedDatasetWriter(prefix, 258, 256) as w:
            w.add_document([1, 2, 256])
            raise RuntimeError("crash")
    assert Path(f"{prefix}.bin").read_bytes() == before  # the old dataset is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    assert [d.tolist() for d in (IndexedDataset(prefix)[i] for i in range(5))] == docs


def test_demo_corpus_builds_from_stdlib(tmp_path):
    cap = 150_000
    files = demo_corpus_files(cap)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files == demo_corpus_files(cap)
    assert all(f.suffix == ".py" and stdlib in f.parents for f in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    assert sum(f.stat().st_size for f in files) <= cap
    assert files[0] == stdlib / "__future__.py"  # sorted walk: top-level files first
    prefix = ensure_demo_dataset(tmp_path / "cache", max_bytes=cap)
    mtime = Path(f"{prefix}.bin").stat().st_mtime_ns
    assert ensure_demo_dataset(tmp_path / "cache", max_bytes=cap) == prefix
    assert Path(f"{prefix}.bin").stat().st_mtime_ns == mtime  # cached, not rebuilt
    ds = IndexedDataset(prefix, verify="full")
    nonempty = [f for f in files if f.stat().st_size]
    assert len(ds) == len(nonempty)
    assert ByteTokenizer().decode(ds[0]) == nonempty[0].read_text(encoding="utf-8")
    assert ensure_demo_dataset(tmp_path / "cache", max_bytes=cap // 2) != prefix


def test_prepare_data_paths(tmp_path):
    src = tmp_path / "src"
    texts = _write_corpus(src)
    built = write_indexed_dataset(tmp_path / "built", [[1, 256]], 258, 256)
    cache = tmp_path / "cache"
    prefixes = prepare_data_paths([str(built), f"{built}.bin", str(src)], "byte", cache)
    assert prefixes[:2] == [built, built]
    assert prefixes[2].parent == cache
    assert [ByteTokenizer().decode(d) for d in _docs_of(prefixes[2])] == texts
    assert prepare_data_paths(str(src), "byte", cache) == [prefixes[2]]
    tok = train_bpe([src], 300, tmp_path / "tok" / "tokenizer.json")
    (bpe,) = prepare_data_paths(str(src), str(tmp_path / "tok"), cache)  # a folder holding tokenizer.json
    assert bpe != prefixes[2] and [tok.decode(d) for d in _docs_of(bpe)] == texts
    with pytest.raises(FileNotFoundError, match="data.path entry 'nowhere' is neither a dataset prefix"):
        prepare_data_paths(["nowhere"], "byte", cache)
