"""Reliability (issue 11), bad inputs: a damaged checkpoint, dataset, Hugging Face folder
or config gives one error naming the file or field, and nothing is written: every file
of the folders involved keeps its bytes and modification time (the damaged one too).

The exact messages of each damage are pinned in tests/training/test_checkpoint.py, tests/data/test_indexed_dataset.py and
tests/config/test_load.py; here each is provoked where a user meets it (resume, open, import,
``moe-fold train``) and the folders are compared before and after."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

import pytest

from moe_fold import cli
from moe_fold.training.checkpoint import CheckpointError
from moe_fold.config import ConfigError, load_config
from moe_fold.data.indexed_dataset import DatasetFormatError, IndexedDataset
from moe_fold.models import from_hf
from moe_fold.models.hf import HFWeightError
from moe_fold.training.train import train
from tests.data.test_indexed_dataset import _make
from tests.models.hf.test_importer import save_hf

SMALL = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.save_every=1", "train.keep_last=2",
    "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
]


def snapshot(*folders) -> dict[str, tuple[str, int]]:
    """sha256 and mtime (ns) of every file under ``folders``."""
    out = {}
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                path = Path(root) / name
                out[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


def _alter(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# --------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("damage, message", [
    (lambda p: _alter(p / "rank_00000.safetensors", -5), r"rank_00000\.safetensors is corrupt: sha256"),
    (lambda p: _truncate(p / "rank_00000.safetensors", 100), r"rank_00000\.safetensors has 100 bytes, index.json"),
    (lambda p: _truncate(p / "rng_00000.json", 10), r"rng_00000\.json has 10 bytes, index.json says"),
    (lambda p: _truncate(p / "index.json", 50), r"cannot read .*step_000002/index\.json"),
], ids=["altered-shard", "truncated-shard", "truncated-rng", "truncated-index"])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_writes_nothing(tmp_path, damage, message):
    run_dir = tmp_path / "run"
    opts = SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    train(load_config("mixtral-tiny", opts + ["train.steps=2"]))
    # Every checkpoint damaged: with an intact older one, resume falls back to it
    # (tests/training/test_checkpoint_fallback.py).
    for step in (1, 2):
        damage(run_dir / "checkpoints" / f"step_{step:06d}")
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=message) as err:
        train(load_config("mixtral-tiny", opts + ["train.steps=3"]), resume=True)
    assert str(run_dir / "checkpoints" / "step_000002") in str(err.value)
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------- datasets

@pytest.mark.parametrize("damage, named, message", [
    (lambda idx, bin_: _alter(idx, 0), "idx", "bad magic"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:8] + struct.pack("<I", 7) + idx.read_bytes()[12:]),
     "idx", "unsupported format version 7"),
    (lambda idx, bin_: _alter(idx, 70), "idx", "checksum mismatch"),
    (lambda idx, bin_: _truncate(idx, len(idx.read_bytes()) - 8), "idx", "size mismatch"),
    (lambda idx, bin_: _alter(bin_, -1), "bin", "checksum mismatch"),
    (lambda idx, bin_: _truncate(bin_, len(bin_.read_bytes()) - 2), "bin", "size mismatch"),
], ids=["idx-magic", "idx-version", "idx-checksum", "idx-size", "bin-checksum", "bin-size"])
def test_damaged_dataset_names_the_file_and_writes_nothing(tmp_path, damage, named, message):
    prefix, _ = _make(tmp_path)
    _make(tmp_path, name="other")  # a neighbour that must stay as it is
    paths = {"idx": Path(f"{prefix}.idx"), "bin": Path(f"{prefix}.bin")}
    damage(paths["idx"], paths["bin"])
    before = snapshot(tmp_path)
    with pytest.raises(DatasetFormatError) as err:
        IndexedDataset(prefix)
    assert str(err.value).startswith(f"{paths[named]}: {message}"), str(err.value)
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- Hugging Face folders

def test_hf_folder_with_a_missing_or_damaged_shard_names_it_and_writes_nothing(tmp_path):
    sharded = tmp_path / "sharded"
    save_hf("qwen2_shared_dense", sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    os.remove(shards[1])
    before = snapshot(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{sharded / 'model.safetensors.index.json'} lists {shards[1].name}, missing from {sharded}")):
        from_hf(sharded)
    assert snapshot(tmp_path) == before

    single = tmp_path / "single"
    save_hf("qwen2_shared_dense", single)
    _truncate(single / "model.safetensors", 1000)
    before = snapshot(tmp_path)
    with pytest.raises(HFWeightError, match=re.escape(
            f"{single / 'model.safetensors'}: not a readable safetensors file (truncated or damaged?)")):
        from_hf(single)
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- configs

@pytest.mark.parametrize("text, message", [
    ("train:\n  stepz: 3\n", "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    ("trian:\n  steps: 3\n", "unknown config section 'trian'; did you mean 'train'?"),
    ("train:\n  micro_batch_size: two\n", "train.micro_batch_size='two' has type str: expected int"),
    ("moe:\n  topk: 1.5\n", "moe.topk=1.5 has type float: expected int"),
])
def test_bad_config_file_is_refused_by_field_and_writes_nothing(tmp_path, capsys, text, message):
    """``load_config`` names the field; ``moe-fold train`` prints it, exits 2 and creates
    no run folder."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(config))
    before = snapshot(tmp_path)
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--set", f"train.run_dir={run_dir}"]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not run_dir.exists() and snapshot(tmp_path) == before
