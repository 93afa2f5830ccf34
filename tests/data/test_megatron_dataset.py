"""Megatron-LM's MMIDIDX (moe_fold/data/megatron_dataset.py), written from its published
description (no Megatron code): our writer byte for byte the published layout (also with int32
token ids), every dtype code read, and sentences grouped into documents."""

from pathlib import Path

import numpy as np
import pytest

from moe_fold.data.loader import GPTDataset
from moe_fold.data.megatron_dataset import MegatronDataset, MegatronDatasetWriter

from tests.helpers.data_formats import CODES, EOD, corpus_docs, megatron_from_spec


def test_megatron_writer_is_byte_for_byte_the_published_layout(tmp_path):
    docs = corpus_docs()
    megatron_from_spec(tmp_path / "spec", docs, 8)  # vocab 258 < 65500: uint16, as preprocess_data.py picks
    with MegatronDatasetWriter(tmp_path / "ours", 258, EOD) as w:
        for d in docs:
            w.add_document(d)
    for ext in ("idx", "bin"):
        assert Path(f"{tmp_path}/ours.{ext}").read_bytes() == Path(f"{tmp_path}/spec.{ext}").read_bytes(), ext
    # A vocabulary of 65,500 or more takes int32 (code 4).
    big = [[0, 70_000, 5], [9, 5]]
    megatron_from_spec(tmp_path / "spec32", big, 4)
    with MegatronDatasetWriter(tmp_path / "ours32", 70_001, 5) as w:
        for d in big:
            w.add_document(d)
    for ext in ("idx", "bin"):
        assert Path(f"{tmp_path}/ours32.{ext}").read_bytes() == Path(f"{tmp_path}/spec32.{ext}").read_bytes(), ext


@pytest.mark.parametrize("code", sorted(CODES))
def test_megatron_every_dtype_code_reads(tmp_path, code):
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ds = MegatronDataset(megatron_from_spec(tmp_path / "m", seqs, code), eod_id=9)
    assert ds.dtype == np.dtype(CODES[code]) and ds.num_tokens == 9
    assert [ds[i].astype(np.int64).tolist() for i in range(3)] == seqs
    sample = GPTDataset(ds, 4, seed=0, vocab_limit=10).raw_sample(1)
    assert sample.tokens.dtype == np.int64 and sample.tokens.tolist() == [5, 6, 7, 8, 9]


def test_megatron_sentences_group_into_documents(tmp_path):
    """With sentence splitting a document is several sequences (document indices 0, 2, 3)."""
    seqs = [[1, 2], [3, EOD], [4, 5, EOD]]
    ds = MegatronDataset(megatron_from_spec(tmp_path / "m", seqs, 8, doc_starts=[0, 2, 3]), EOD)
    assert ds.offsets.tolist() == [0, 4, 7] and ds[0].tolist() == [1, 2, 3, EOD]
    packed = GPTDataset(ds, 3, seed=0, packing=True)
    assert packed.raw_sample(0).tokens.tolist() == [1, 2, 3, EOD]
