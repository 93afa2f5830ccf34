"""Tokenizers (moe_fold/data/tokenizer.py): the byte tokenizer round-trips any text and keeps
its special ids out of it, a trained BPE round-trips and compresses, and a Hugging Face
tokenizer file that is missing or wrong is refused."""

import re

import pytest

from moe_fold.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

from tests.helpers.data_formats import write_corpus


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


def test_trained_bpe_round_trips_and_compresses(tmp_path):
    texts = write_corpus(tmp_path / "src")
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
