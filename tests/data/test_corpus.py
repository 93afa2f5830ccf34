"""The demo corpus and data paths (moe_fold/data/corpus.py): the demo dataset built from the
standard library once and reused, and data.path entries prepared (built, cached, tokenized)."""

import sysconfig
from pathlib import Path

import pytest

from moe_fold.data.corpus import demo_corpus_files, ensure_demo_dataset, prepare_data_paths
from moe_fold.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from moe_fold.data.tokenizer import ByteTokenizer, train_bpe

from tests.helpers.data_formats import docs_of, write_corpus


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
    texts = write_corpus(src)
    built = write_indexed_dataset(tmp_path / "built", [[1, 256]], 258, 256)
    cache = tmp_path / "cache"
    prefixes = prepare_data_paths([str(built), f"{built}.bin", str(src)], "byte", cache)
    assert prefixes[:2] == [built, built]
    assert prefixes[2].parent == cache
    assert [ByteTokenizer().decode(d) for d in docs_of(prefixes[2])] == texts
    assert prepare_data_paths(str(src), "byte", cache) == [prefixes[2]]
    tok = train_bpe([src], 300, tmp_path / "tok" / "tokenizer.json")
    (bpe,) = prepare_data_paths(str(src), str(tmp_path / "tok"), cache)  # a folder holding tokenizer.json
    assert bpe != prefixes[2] and [tok.decode(d) for d in docs_of(bpe)] == texts
    with pytest.raises(FileNotFoundError, match="data.path entry 'nowhere' is neither a dataset prefix"):
        prepare_data_paths(["nowhere"], "byte", cache)
