"""Tokenized data made elsewhere, read in place through one stream: Megatron-LM's MMIDIDX,
flat token files (.npy, raw .bin), Hugging Face ``save_to_disk`` folders and Parquet give the
same documents, samples and losses; blending across formats, exact resume, dp sharding;
parallel builds (``--workers``); and every bad-input error, each before any rank starts.
Megatron's format on its own: tests/data/test_megatron_dataset.py; ``moe-fold data inspect``:
tests/data/test_inspect.py; the command: tests/cli/test_data.py. The formats are written by
tests/helpers/data_formats.py (Megatron's from its published description, no Megatron code:
magic, version, dtype code, counts, int32 lengths, int64 byte pointers, int64 document
indices, all little-endian)."""

from __future__ import annotations

import gzip
import os
import re
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from moe_fold.cli import main as cli_main
from moe_fold.config import load_config
from moe_fold.data.indexed_dataset import DatasetFormatError, IndexedDataset, write_indexed_dataset
from moe_fold.data.loader import DataLoader, GPTDataset, open_training_dataset
from moe_fold.data.preprocess import build_dataset
from moe_fold.data.sources import check_data, detect_format, open_tokens
from moe_fold.data.tokenizer import ByteTokenizer, train_bpe

from tests.helpers.data_formats import EOD, corpus_docs, corpus_texts, megatron_from_spec, write_all_formats


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, str]:
    return write_all_formats(tmp_path_factory.mktemp("formats"), corpus_docs())


# --------------------------------------------------------------------------- every format, one stream

def test_every_format_reads_the_same_documents(formats):
    docs = corpus_docs()
    for fmt, path in formats.items():
        source = open_tokens(path, EOD, dtype="uint16")
        assert (detect_format(path)[0], source.format) == (fmt, fmt)
        assert source.num_tokens == sum(map(len, docs)), fmt
        assert source.offsets.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist(), fmt
        assert [np.asarray(source[i]).tolist() for i in (0, 7, len(docs) - 1)] == [docs[0], docs[7], docs[-1]], fmt
        assert np.asarray(source.tokens[5:300]).tolist() == sum(docs, [])[5:300], fmt


@pytest.mark.parametrize("kwargs", [{}, {"packing": True}, {"reset_at_documents": True}],
                         ids=["fixed", "packed", "reset"])
def test_every_format_gives_the_same_samples(formats, kwargs):
    ref = GPTDataset(formats["moefidx"], 24, seed=3, **kwargs)
    for fmt, path in formats.items():
        ds = GPTDataset(open_tokens(path, EOD, dtype="uint16"), 24, seed=3, vocab_limit=264, **kwargs)
        assert len(ds) == len(ref), fmt
        for i in range(len(ds) + 3):  # into the second epoch
            a, b = ref[i], ds[i]
            for field in ("tokens", "loss_mask", "positions", "cu_seqlens", "token_mask"):
                assert np.array_equal(getattr(a, field), getattr(b, field)), (fmt, i, field)


def test_blend_across_formats_resumes_exactly_and_shards_over_dp(formats):
    """A blend of Megatron + .npy + HF datasets draws the samples the same blend of
    moe-fold datasets draws; a loader resumed from its state continues exactly; two dp
    ranks together see each global batch once."""
    mixed = [formats["megatron"], formats["npy"], formats["hf-arrow"]]
    same = [formats["moefidx"]] * 3
    w = [0.5, 0.3, 0.2]
    a = open_training_dataset(mixed, w, 16, seed=1, blend_size=50, eod_id=EOD, max_vocab_size=264)
    b = open_training_dataset(same, w, 16, seed=1, blend_size=50, eod_id=EOD, max_vocab_size=264)
    assert all(np.array_equal(a[i].tokens, b[i].tokens) for i in range(120))

    straight = DataLoader(a, 8, 2, dp_rank=0, dp_size=2)
    it = iter(straight)
    [next(it) for _ in range(3)]
    state = straight.state_dict()
    expected = [next(it).tokens for _ in range(4)]
    resumed = DataLoader(open_training_dataset(mixed, w, 16, seed=1, blend_size=50, eod_id=EOD), 8, 2, 0, 2)
    resumed.load_state_dict(state)
    assert all(np.array_equal(x, y.tokens) for x, y in zip(expected, iter(resumed)))

    ranks = [next(iter(DataLoader(a, 8, 2, dp_rank=r, dp_size=2))).tokens for r in range(2)]
    one = next(iter(DataLoader(a, 8, 4, dp_rank=0, dp_size=1))).tokens
    assert np.array_equal(np.concatenate(ranks), one)


def test_hf_text_columns_and_compressed_jsonl_are_tokenized(tmp_path):
    import datasets
    import zstandard

    texts = corpus_texts(20)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hftext"))
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "t.parquet"))
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "t.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    assert detect_format(tmp_path / "hftext")[0] == "hf-text"
    want = corpus_docs(texts)
    for entry, key in [("hftext", "text"), ("t.parquet", "body"), ("t.jsonl.gz", "text"), ("t.jsonl.zst", "text")]:
        config = load_config("mixtral-tiny", [f"data.path={tmp_path / entry}", f"data.text_key={key}",
                                              f"data.cache_dir={tmp_path / 'cache'}", "model.seq_length=16"])
        from moe_fold.data.loader import dataset_from_config

        ds = dataset_from_config(config).indexed
        assert [ds[i].tolist() for i in range(len(ds))] == want, entry


# --------------------------------------------------------------------------- training

def _losses(run_dir, cache, path: str, *extra) -> list[float]:
    from moe_fold.training.train import train

    overrides = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
                 "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=3",
                 "train.save_every=1000", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
                 f"train.run_dir={run_dir}", f"data.cache_dir={cache}", f"data.path={path}", *extra]
    return train(load_config("mixtral-tiny", overrides)).losses


@pytest.mark.slow
def test_every_format_trains_to_the_same_losses(tmp_path, formats):
    """The same corpus as moe-fold, Megatron, .npy, raw .bin, a saved HF dataset and
    Parquet: three training steps give the same losses, bit for bit (the same token
    stream makes the same samples, so the same float operations run)."""
    ref = _losses(tmp_path / "ref", tmp_path / "cache", formats["moefidx"])
    for fmt in ("megatron", "npy", "raw", "hf-arrow", "hf-parquet"):
        got = _losses(tmp_path / fmt, tmp_path / "cache", formats[fmt], "data.dtype=uint16")
        assert got == ref, fmt


# --------------------------------------------------------------------------- --workers

def test_workers_give_identical_bytes(tmp_path):
    """--workers 2 writes the bytes --workers 1 writes (BPE, mixed plain/gz/zst inputs,
    units cut mid-file), in both output formats."""
    import zstandard

    texts = corpus_texts(600)
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        part = "".join(json.dumps({"text": t}) + "\n" for t in texts[k * 200:(k + 1) * 200]).encode()
        (src / f"p{k}.jsonl").write_bytes(part)
    (src / "p1.jsonl").rename(src / "p1.jsonl.gz.tmp")
    (src / "p1.jsonl.gz").write_bytes(gzip.compress((src / "p1.jsonl.gz.tmp").read_bytes()))
    (src / "p1.jsonl.gz.tmp").unlink()
    (src / "p2.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((src / "p2.jsonl").read_bytes()))
    (src / "p2.jsonl").unlink()
    (src / "notes.txt").write_text("a plain text file, one document")
    tok = train_bpe([src], 300, tmp_path / "tok.json")
    import moe_fold.data.preprocess as pre

    old = pre._UNIT_DOCS
    pre._UNIT_DOCS = 64  # several units per file, so the workers interleave
    try:
        for fmt in ("moefidx", "megatron"):
            s1 = build_dataset([src], tok, tmp_path / f"w1-{fmt}", workers=1, output_format=fmt)
            s2 = build_dataset([src], tok, tmp_path / f"w2-{fmt}", workers=2, output_format=fmt)
            assert s1.documents == s2.documents == 601 and s1.tokens == s2.tokens
            for ext in ("bin", "idx"):
                assert Path(f"{tmp_path}/w2-{fmt}.{ext}").read_bytes() == Path(f"{tmp_path}/w1-{fmt}.{ext}").read_bytes()
    finally:
        pre._UNIT_DOCS = old
    ds = IndexedDataset(tmp_path / "w2-moefidx")
    assert tok.decode(ds[0]) == "a plain text file, one document"  # notes.txt sorts first
    assert tok.decode(ds[1]) == texts[0] and tok.decode(ds[600]) == texts[-1]


def test_failed_parallel_build_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(300)))
    (src / "b.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(ValueError, match=f"{src / 'b.jsonl'}:2: not valid JSON"):
        build_dataset([src], ByteTokenizer(), tmp_path / "out" / "ds", workers=2)
    assert list((tmp_path / "out").iterdir()) == []  # no final names, no temporaries


# --------------------------------------------------------------------------- bad input

def _config(path, *extra):
    return load_config("mixtral-tiny", [f"data.path={path}", "model.seq_length=16", *extra])


def _bad_inputs(tmp: Path) -> list[tuple[str, Path | str, str, tuple[str, ...]]]:
    """(case, data.path, file named, phrases of the message) for each bad input."""
    docs = corpus_docs()
    cases = []
    m = megatron_from_spec(tmp / "trunc", docs, 8)
    bin_ = Path(f"{m}.bin")
    size = bin_.stat().st_size
    bin_.write_bytes(bin_.read_bytes()[:size - 6])
    cases.append(("truncated megatron .bin", m, bin_, (f"ends at byte offset {size - 6}", f"{size} bytes",
                                                        "must be exactly that size")))
    f = write_indexed_dataset(tmp / "ftrunc", docs, 258, EOD)
    fb = Path(f"{f}.bin")
    fb.write_bytes(fb.read_bytes()[:-4])
    cases.append(("truncated moe-fold .bin", f, fb, (f"ends at byte offset {fb.stat().st_size}",
                                                      "must be exactly that size")))
    np.concatenate(docs).astype(np.uint16).tofile(tmp / "odd.bin")
    with open(tmp / "odd.bin", "ab") as fh:
        fh.write(b"\x01")
    cases.append(("truncated raw .bin", tmp / "odd.bin", tmp / "odd.bin",
                  ("is not a whole number of uint16 tokens", f"byte offset {2 * sum(map(len, docs))}")))
    over = [d + [1] * 50 if i == 3 else d for i, d in enumerate(docs)]
    megatron_from_spec(tmp / "over", over, 8)
    megatron_from_spec(tmp / "short", docs, 8)
    Path(f"{tmp}/over.bin").write_bytes(Path(f"{tmp}/short.bin").read_bytes())  # the .idx counts 50 more
    cases.append((".idx counts exceed the .bin", tmp / "over", Path(f"{tmp}/over.bin"),
                  (f"ends at byte offset {2 * sum(map(len, docs))}", f"counts {sum(map(len, over))} tokens")))
    megatron_from_spec(tmp / "magic", docs, 8)
    Path(f"{tmp}/magic.idx").write_bytes(b"NOTANIDX!" + Path(f"{tmp}/magic.idx").read_bytes()[9:])
    cases.append(("wrong magic", tmp / "magic", Path(f"{tmp}/magic.idx"),
                  ("bytes [0, 9) are b'NOTANIDX!'", "starts with b'MOEFIDX\\x00' (moe-fold) or "
                                                    "b'MMIDIDX\\x00\\x00' (Megatron-LM)")))
    megatron_from_spec(tmp / "version", docs, 8)
    raw = Path(f"{tmp}/version.idx").read_bytes()
    Path(f"{tmp}/version.idx").write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    cases.append(("wrong megatron version", tmp / "version", Path(f"{tmp}/version.idx"),
                  ("version 2 at byte offset 9", "knows Megatron index version 1")))
    v = write_indexed_dataset(tmp / "fversion", docs, 258, EOD)
    raw = Path(f"{v}.idx").read_bytes()
    Path(f"{v}.idx").write_bytes(raw[:8] + struct.pack("<I", 2) + raw[12:])
    cases.append(("wrong moe-fold version", v, Path(f"{v}.idx"), ("version 2 at byte offset 8", "reads version 1")))
    ids = np.concatenate(docs).astype(np.uint16)
    ids[1000] = 264  # one past mixtral-tiny's 264 ids
    np.save(tmp / "vocab.npy", ids)
    cases.append(("token id outside the vocabulary (.npy)", tmp / "vocab.npy", tmp / "vocab.npy",
                  ("token id 264 at token offset 1000 (byte offset 2000)", "[0, model.vocab_size=264)")))
    mdocs = [list(d) for d in docs]
    mdocs[5][2] = 5000
    megatron_from_spec(tmp / "mvocab", mdocs, 8)
    at = sum(map(len, docs[:5])) + 2
    cases.append(("token id outside the vocabulary (Megatron)", tmp / "mvocab", Path(f"{tmp}/mvocab.bin"),
                  (f"token id 5000 at token offset {at} (byte offset {2 * at})", "outside the vocabulary")))
    np.save(tmp / "empty.npy", np.zeros(0, np.uint16))
    cases.append(("empty dataset (.npy)", tmp / "empty.npy", tmp / "empty.npy",
                  ("empty dataset: 0 tokens at byte offset 0", "at least model.seq_length+1=17 tokens")))
    megatron_from_spec(tmp / "mempty", [], 8)
    cases.append(("empty dataset (Megatron)", tmp / "mempty", Path(f"{tmp}/mempty.bin"),
                  ("empty dataset: 0 tokens",)))
    return cases


def test_every_bad_input_fails_before_any_rank_with_file_offset_and_rule(tmp_path, capsys, monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned for a bad dataset")

    monkeypatch.setattr("moe_fold.launch.run_ranks", no_spawn)
    cases = _bad_inputs(tmp_path)
    assert len(cases) == 11
    for case, path, named, phrases in cases:
        with pytest.raises(DatasetFormatError) as info:
            check_data(_config(path, "data.dtype=uint16"))
        message = str(info.value)
        assert message.startswith(f"{named}: "), (case, message)
        for phrase in phrases:
            assert phrase in message, (case, phrase, message)
        # The command refuses it the same way, before spawning its 2 ranks.
        assert cli_main(["train", "--config", "mixtral-tiny", "--nproc", "2", "--set", "wandb.mode=disabled",
                         "--set", "model.seq_length=16", "--set", "data.dtype=uint16",
                         "--set", f"data.path={path}", "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2, case
        assert phrases[0] in " ".join(capsys.readouterr().err.split()), case


def test_empty_text_corpus_and_empty_hf_dataset(tmp_path):
    import datasets

    (tmp_path / "e.jsonl").write_text('{"text": ""}\n\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"empty dataset: the 1 input files \(.*e.jsonl\) hold no non-empty "
                                         r"document \(2 empty ones\)"):
        build_dataset([tmp_path / "e.jsonl"], ByteTokenizer(), tmp_path / "out")
    assert not list(tmp_path.glob("out*"))
    datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).select([]).save_to_disk(str(tmp_path / "hf0"))
    with pytest.raises(DatasetFormatError, match=re.escape(f"{tmp_path / 'hf0'}: empty dataset: 0 tokens")):
        check_data(_config(tmp_path / "hf0"))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 20})})
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DatasetFormatError, match=re.escape(f"{tmp_path / 'dict'}: a DatasetDict (splits train): "
                                                           f"give one split's folder, e.g. {tmp_path / 'dict' / 'train'}")):
        check_data(_config(tmp_path / "dict"))
    assert detect_format(tmp_path / "dict" / "train")[0] == "hf-arrow"


def test_loader_checks_every_sample_it_reads(tmp_path):
    """A bad id the sampled pre-check skipped still stops training at the sample that
    holds it, naming the file and offset, instead of indexing outside the embedding."""
    ids = np.full(3 << 20, 7, np.uint16)  # 3 blocks of 2^20 tokens
    ids[(1 << 20) + 12345] = 999
    np.save(tmp_path / "t.npy", ids)
    source = open_tokens(tmp_path / "t.npy", EOD)
    ds = GPTDataset(source, 64, seed=0, vocab_limit=264)
    j = ((1 << 20) + 12345) // 64
    with pytest.raises(DatasetFormatError, match=re.escape(
            f"{tmp_path / 't.npy'}: token id 999 at token offset {(1 << 20) + 12345}")):
        ds.raw_sample(j)
    ds.raw_sample(j + 1)  # the others read fine


def test_raw_bin_needs_a_dtype_and_eod(tmp_path):
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "x.bin")
    with pytest.raises(DatasetFormatError, match="a raw token file has no header, so data.dtype must name"):
        open_tokens(tmp_path / "x.bin", EOD)
    with pytest.raises(ValueError, match="a raw dataset stores no end-of-document id: set data.eod_id"):
        open_tokens(tmp_path / "x.bin", None, "uint16")
    from moe_fold.config import ConfigError, validate

    for bad, rule in [("data.dtype=float16", "data.dtype=float16 must be one of uint8, uint16"),
                      ("data.eod_id=264", "data.eod_id=264 must be in [0, model.vocab_size=264)"),
                      ("data.verify=some", "data.verify=some must be one of sampled, full")]:
        with pytest.raises(ConfigError, match=re.escape(rule)):
            validate(load_config("mixtral-tiny", [bad]), 2)


@pytest.mark.parametrize("fmt", ["moefidx", "megatron"])
def test_killed_build_leaves_no_final_name_and_restarts_clean(tmp_path, fmt):
    """A writer killed outright (SIGKILL: no clean-up runs) leaves its temporaries and no
    dataset; building again writes the dataset and removes the dead job's temporaries,
    but not those of a live process or of another host."""
    import socket
    import subprocess
    import sys

    prefix = tmp_path / "out" / "ds"
    writer = ("MegatronDatasetWriter(p, 258, 256)" if fmt == "megatron" else "IndexedDatasetWriter(p, 258, 256)")
    script = (f"import os, signal\nfrom moe_fold.data.indexed_dataset import IndexedDatasetWriter\n"
              f"from moe_fold.data.megatron_dataset import MegatronDatasetWriter\n"
              f"p = {str(prefix)!r}\nw = {writer}\nw.add_document([1, 2, 256])\n"
              f"os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9
    left = sorted(p.name for p in prefix.parent.iterdir())
    assert len(left) == 1 and left[0].startswith("ds.bin.tmp-")  # no final name
    host, dead = socket.gethostname().replace("-", "_"), left[0].rsplit("-", 1)[1]
    kept = [prefix.parent / f"ds.bin.tmp-{host}-{dead}x", prefix.parent / f"ds.idx.tmp-other_host-{dead}"]
    live = prefix.parent / f"ds.bin.tmp-{host}-{os.getppid()}"
    for f in kept + [live]:
        f.write_bytes(b"partial")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "again"}) + "\n")
    build_dataset([tmp_path / "c.jsonl"], ByteTokenizer(), prefix, output_format=fmt)
    assert sorted(p.name for p in prefix.parent.iterdir()) == sorted(["ds.bin", "ds.idx"] + [f.name for f in kept + [live]])
    assert open_tokens(prefix, EOD)[0].tolist() == list(b"again") + [EOD]
