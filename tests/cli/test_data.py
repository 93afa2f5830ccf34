"""`moe-fold data` (moe_fold/cli/data.py): a folder and a JSONL file into our format (bytes or a
trained BPE) and into Megatron's format (one worker or two, byte-identical to Megatron's own
writer), its refusals and its help. The formats themselves: tests/data/."""

import json
from pathlib import Path

import pytest

from moe_fold.cli import main as cli_main
from moe_fold.data.indexed_dataset import IndexedDataset
from moe_fold.data.megatron_dataset import MegatronDataset
from moe_fold.data.tokenizer import ByteTokenizer, load_tokenizer

from tests.helpers.data_formats import docs_of, write_corpus
from tests.helpers.data_formats import EOD, corpus_docs, corpus_texts, megatron_from_spec


def test_cli_end_to_end(tmp_path, capsys):
    src = tmp_path / "src"
    texts = write_corpus(src)
    (src / "notes.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    out = tmp_path / "data" / "ds"
    assert cli_main(["data", str(src), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}.bin/.idx: 21 files, 21 documents" in printed
    byte = ByteTokenizer()
    assert [byte.decode(d) for d in docs_of(out)] == texts + ["from jsonl"]

    bpe_out = tmp_path / "data" / "bpe"
    assert cli_main(["data", str(src), "--train-bpe", "300", "--output", str(bpe_out), "--ext", ".py"]) == 0
    tok = load_tokenizer(f"{bpe_out}.tokenizer.json")
    docs = docs_of(bpe_out)
    assert [tok.decode(d) for d in docs] == texts
    assert all(d[-1] == tok.eod_id for d in docs)
    assert IndexedDataset(bpe_out).vocab_size == tok.vocab_size

    assert cli_main(["data", str(tmp_path / "missing"), "--output", str(out)]) == 2
    assert "moe-fold data: error: input" in capsys.readouterr().err
    assert cli_main(["data", "--output", str(out)]) == 2
    assert "no inputs" in capsys.readouterr().err
    assert cli_main(["data", str(src), "--output", str(tmp_path)]) == 2
    assert f"--output {tmp_path} is a folder; give a prefix" in capsys.readouterr().err
    assert cli_main(["data", str(src), "--train-bpe", "300", "--tokenizer", "t.json", "--output", str(out)]) == 2
    assert "--train-bpe and --tokenizer are exclusive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["data", "--help"])
    assert "examples:" in capsys.readouterr().out


def test_cli_format_megatron_round_trips(tmp_path, capsys):
    texts = corpus_texts(12)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert cli_main(["data", str(tmp_path / "c.jsonl"), "--format", "megatron", "--output",
                     str(tmp_path / "m" / "c_text_document")]) == 0
    assert "format megatron" in capsys.readouterr().out
    assert cli_main(["data", str(tmp_path / "c.jsonl"), "--format", "megatron", "--workers", "2", "--output",
                     str(tmp_path / "m" / "w2")]) == 0
    megatron_from_spec(tmp_path / "spec", corpus_docs(texts), 8)
    for ext in ("idx", "bin"):
        for prefix in ("c_text_document", "w2"):
            assert Path(f"{tmp_path}/m/{prefix}.{ext}").read_bytes() == Path(f"{tmp_path}/spec.{ext}").read_bytes()
    capsys.readouterr()
    assert cli_main(["data", str(tmp_path / "c.jsonl"), "--workers", "0", "--output", str(tmp_path / "x")]) == 2
    assert "--workers=0 must be >= 1" in capsys.readouterr().err
    ds = MegatronDataset(tmp_path / "m" / "c_text_document", EOD)
    assert [ByteTokenizer().decode(ds[i]) for i in range(len(ds))] == texts
