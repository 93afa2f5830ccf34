"""Preprocessing (moe_fold/data/preprocess.py): a folder and JSONL files into exactly the tokens
of their texts. Its parts: tests/data/test_tokenizer.py, test_indexed_dataset.py,
test_documents.py, test_corpus.py; the command `moe-fold data`: tests/cli/test_data.py."""

from __future__ import annotations

import json

import numpy as np

from moe_fold.data.indexed_dataset import IndexedDataset
from moe_fold.data.preprocess import build_dataset
from moe_fold.data.tokenizer import ByteTokenizer

from tests.helpers.data_formats import docs_of


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
    assert docs_of(tmp_path / "out" / "ds") == [list(t.encode()) + [256] for t in expected_texts]
    assert (summary.files, summary.documents, summary.skipped_empty) == (3, 4, 1)
    assert summary.tokens == sum(len(t.encode()) + 1 for t in expected_texts)
    ds = IndexedDataset(tmp_path / "out" / "ds")
    assert ds.dtype == np.uint16 and ds.vocab_size == 258 and ds.eod_id == 256
    build_dataset([src], tok, tmp_path / "out" / "again", text_key="body", progress=True)
    for ext in ("bin", "idx"):  # the progress bar changes nothing in the output
        assert (tmp_path / "out" / f"again.{ext}").read_bytes() == (tmp_path / "out" / f"ds.{ext}").read_bytes()
    assert ByteTokenizer().decode(ds[3]) == "jsonl two 日本"
