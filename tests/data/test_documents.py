"""Input documents (moe_fold/data/documents.py): JSONL with a byte-order mark and escaped
surrogates, and errors that name the file and the line."""

import re

import pytest

from moe_fold.data.documents import find_input_files
from moe_fold.data.preprocess import build_dataset
from moe_fold.data.tokenizer import ByteTokenizer

from tests.helpers.data_formats import docs_of



def test_jsonl_bom_and_escaped_surrogates(tmp_path):
    f = tmp_path / "odd.jsonl"
    # A byte-order mark, an escaped surrogate pair (one emoji) and a lone surrogate.
    f.write_bytes(b"\xef\xbb\xbf" + b'{"text": "pair \\ud83d\\ude00 lone \\ud800 end"}\n')
    build_dataset([f], ByteTokenizer(), tmp_path / "ds")
    assert ByteTokenizer().decode(docs_of(tmp_path / "ds")[0]) == "pair \U0001F600 lone \ufffd end"


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
