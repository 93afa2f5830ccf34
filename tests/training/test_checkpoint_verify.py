"""Checkpoint integrity (issue 17): the manifest's sha256 names a corrupted shard at load
and in `moe-fold checkpoint verify`; a lost expert shard or a dropped expert tensor is
reported per layer and expert by verify and refused by the Hugging Face export."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from moe_fold import cli
from moe_fold.launch import run_ranks
from moe_fold.models.model import build_model
from moe_fold.layout import ProcessGroups
from moe_fold.training.checkpoint import CheckpointError, load_checkpoint, write_index
from moe_fold.training.checkpoint_verify import verify_checkpoint
from moe_fold.training.train import train
from tests.training.test_train import small_config


def _train_rank(rank, world_size, config):
    return train(config).checkpoint


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """One step of mixtral-tiny (small) on 2 ranks with ep=2: rank 0's shard holds
    experts 0-3 of every layer, rank 1's experts 4-7."""
    root = tmp_path_factory.mktemp("ep2")
    config = small_config(root / "run", root / "cache", "train.steps=1", "parallel.ep=2")
    run_ranks(_train_rank, 2, config, timeout=300)
    return root / "run"


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_000001"


def test_a_whole_checkpoint_verifies(ep2_run, capsys):
    report = verify_checkpoint(ep2_run / "checkpoints" / "step_000001")
    assert report.ok and report.moe_layers == [0, 1] and report.num_experts == 8
    assert report.files_checked == 5  # 2 shards, 2 rng files, config.yaml
    assert cli.main(["checkpoint", "verify", str(ep2_run)]) == 0
    out = capsys.readouterr().out
    assert "step_000001: OK (5 files match the manifest; 2 MoE layers x 8 experts present)" in out
    assert "1 of 1 checkpoints whole" in out


def test_a_flipped_byte_is_named_at_load_and_by_verify(ep2_run, tmp_path, capsys):
    run, path = _copy(ep2_run, tmp_path)
    shard = path / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    config = small_config(run, tmp_path / "cache", "parallel.ep=1")
    with pytest.raises(CheckpointError, match=r"checkpoint file .*rank_00001\.safetensors is corrupt: sha256"):
        load_checkpoint(path, build_model(config, ProcessGroups.single_process()), None, None,
                        ProcessGroups.single_process())
    report = verify_checkpoint(path)
    assert list(report.bad_files) == ["rank_00001.safetensors"]
    assert report.bad_files["rank_00001.safetensors"].startswith("is corrupt: sha256")
    assert cli.main(["checkpoint", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: DAMAGED" in out and "file rank_00001.safetensors is corrupt: sha256" in out
    assert "layer 0 expert 4: missing from model/layers.0.mlp.experts.fc1" in out
    # --no-checksums sees sizes only: a flipped byte passes it
    assert cli.main(["checkpoint", "verify", str(path), "--no-checksums"]) == 0


def _change_at_the_same_size(path):
    """Damage that keeps the size and the file readable: a byte of a shard's data, the data
    position in index.json, a digit of the other (text) files."""
    if path.name == "index.json":
        text = path.read_text()
        changed = re.sub(r'("consumed_samples": \d*)(\d)', lambda m: m[1] + str(int(m[2]) % 9 + 1), text, count=1)
        path.write_text(changed)
    elif path.suffix == ".safetensors":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        text = path.read_text()
        at = next(i for i in range(len(text) // 2, len(text)) if text[i].isdigit())
        path.write_text(text[:at] + str(int(text[at]) % 9 + 1) + text[at + 1:])


FILES = ["config.yaml", "index.json", "rank_00000.safetensors", "rank_00001.safetensors", "rng_00000.json",
         "rng_00001.json"]


@pytest.mark.parametrize("name", FILES)
def test_same_size_damage_to_any_file_is_named_at_load_and_by_verify(ep2_run, tmp_path, capsys, name):
    """Each file of the checkpoint (FILES: every file it holds) altered at the same size:
    loading under one process and `moe-fold checkpoint verify` name that file (index.json
    by its own sha256)."""
    assert sorted(p.name for p in (ep2_run / "checkpoints" / "step_000001").iterdir()) == FILES
    run, path = _copy(ep2_run, tmp_path)
    before = (path / name).read_bytes()
    _change_at_the_same_size(path / name)
    after = (path / name).read_bytes()
    assert len(after) == len(before) and after != before
    config = small_config(run, tmp_path / "cache", "parallel.ep=1")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path / name))} is corrupt: .*sha256"):
        load_checkpoint(path, build_model(config, ProcessGroups.single_process()), None, None,
                        ProcessGroups.single_process())
    report = verify_checkpoint(path)
    if name == "index.json":
        assert len(report.problems) == 1 and report.problems[0].startswith(
            f"{path / name} is corrupt: its content's sha256 "), report.problems
        assert report.problems[0].endswith(f"differs from its index_sha256 {json.loads(after)['index_sha256']}")
    else:
        assert list(report.bad_files) == [name] and report.bad_files[name].startswith("is corrupt: sha256")
    assert cli.main(["checkpoint", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: DAMAGED" in out and name in out.split("DAMAGED", 1)[1]


def test_a_version_1_index_loads_with_a_warning(ep2_run, tmp_path):
    """Checkpoints saved before index.json was signed (version 1, no index_sha256) still
    load, with a warning that their index is unchecked; a version 2 index whose version
    was changed to 1 is refused."""
    run, path = _copy(ep2_run, tmp_path)
    signed = json.loads((path / "index.json").read_text())
    assert signed["version"] == 2
    old = {k: v for k, v in signed.items() if k != "index_sha256"}
    (path / "index.json").write_text(json.dumps({**old, "version": 1}))
    one = ProcessGroups.single_process()
    model = build_model(small_config(run, tmp_path / "cache", "parallel.ep=1"), one)
    with pytest.warns(UserWarning, match=r"index.json is a version 1 index, which has no sha256 of its own"):
        assert load_checkpoint(path, model, None, None, one)["step"] == 1
    (path / "index.json").write_text(json.dumps({**signed, "version": 1}))
    with pytest.raises(CheckpointError, match=r"index.json is corrupt: its content's sha256"):
        load_checkpoint(path, model, None, None, one)


def test_a_lost_expert_shard_is_reported_and_refused_by_export(ep2_run, tmp_path, capsys):
    run, path = _copy(ep2_run, tmp_path)
    (path / "rank_00001.safetensors").unlink()
    report = verify_checkpoint(path)
    assert report.bad_files == {"rank_00001.safetensors": "is missing"}
    assert {layer: sorted(e) for layer, e in report.missing_experts.items()} == {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}
    assert report.missing_experts[0][4] == ["model/layers.0.mlp.experts.fc1", "model/layers.0.mlp.experts.fc2",
                                            "optim/exp_avg/layers.0.mlp.experts.fc1",
                                            "optim/exp_avg/layers.0.mlp.experts.fc2",
                                            "optim/exp_avg_sq/layers.0.mlp.experts.fc1",
                                            "optim/exp_avg_sq/layers.0.mlp.experts.fc2"]
    assert cli.main(["checkpoint", "verify", str(run)]) == 1
    assert "file rank_00001.safetensors is missing" in capsys.readouterr().out
    assert cli.main(["convert", str(run), str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"{path} cannot be exported: layer 0: experts [4, 5, 6, 7] of 8 missing (in "
            f"model/layers.0.mlp.experts.fc1, model/layers.0.mlp.experts.fc2, optim/exp_avg/layers.0.mlp.experts.fc1 "
            f"...); layer 1: experts [4, 5, 6, 7] of 8 missing") in err
    assert not (tmp_path / "hf").exists()


def test_a_dropped_expert_tensor_or_piece_is_reported_and_refused_by_export(ep2_run, tmp_path, capsys):
    run, path = _copy(ep2_run, tmp_path)
    index = json.loads((path / "index.json").read_text())
    del index["tensors"]["model/layers.1.mlp.experts.fc2"]
    pieces = index["tensors"]["model/layers.0.mlp.experts.fc1"]["pieces"]
    index["tensors"]["model/layers.0.mlp.experts.fc1"]["pieces"] = [p for p in pieces if p["offsets"][0] != 4]
    write_index(path, index)  # signed again: a saver that lost them, not damage on disk
    report = verify_checkpoint(path)
    assert not report.bad_files and not report.problems
    assert report.missing_experts[1] == {e: ["model/layers.1.mlp.experts.fc2"] for e in range(8)}
    assert report.missing_experts[0] == {e: ["model/layers.0.mlp.experts.fc1"] for e in (4, 5, 6, 7)}
    assert cli.main(["convert", str(path), str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported: layer 0: experts [4, 5, 6, 7] of 8 missing (in model/layers.0.mlp.experts.fc1)" in err
    assert "layer 1: experts [0, 1, 2, 3, 4, 5, 6, 7] of 8 missing (in model/layers.1.mlp.experts.fc2)" in err


def test_verify_reports_unfinished_saves_and_refuses_an_empty_folder(ep2_run, tmp_path, capsys):
    run, _ = _copy(ep2_run, tmp_path)
    (run / "checkpoints" / "step_000002.tmp-abcd").mkdir()
    assert cli.main(["checkpoint", "verify", str(run)]) == 0
    assert "step_000002.tmp-abcd: unfinished save (no index.json; resuming ignores it" in capsys.readouterr().out
    assert cli.main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_help_shows_the_examples(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["checkpoint", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "moe-fold checkpoint verify runs/mixtral-tiny" in out and "Exit status 0" in out
    assert "checkpoint" in cli._parser().format_help()


def test_an_unreadable_manifest_is_reported(ep2_run, tmp_path, capsys):
    run, path = _copy(ep2_run, tmp_path)
    (path / "index.json").write_text('{"format": "moe-fold-checkpoint", "vers')
    assert cli.main(["checkpoint", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: DAMAGED" in out and f"cannot read {path / 'index.json'}" in out
