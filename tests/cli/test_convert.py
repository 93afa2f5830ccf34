"""`moe-fold convert`: Hugging Face folder -> moe-fold checkpoint -> Hugging Face folder,
on one process and on two ranks (ep 2), with the logits of transformers' model kept;
a checkpoint of a short training run exports with our logits; bad inputs are refused."""

import contextlib
import json

import pytest
import torch
import transformers

from moe_fold import cli
from moe_fold.training.checkpoint import latest_checkpoint, load_checkpoint
from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model

from tests.models.hf.test_importer import TOL, hf_logits, max_diff, our_logits, save_hf, token_ids


def _load(run_dir):
    """Our single-process model from the newest checkpoint of ``run_dir``."""
    path = latest_checkpoint(run_dir)
    model = build_model(load_config(path / "config.yaml"), ProcessGroups.single_process())
    other_layout = json.loads((path / "index.json").read_text())["layout"]["world_size"] > 1
    with pytest.warns(UserWarning, match="random states are not restored") if other_layout else contextlib.nullcontext():
        load_checkpoint(path, model, None, None, ProcessGroups.single_process())
    return model


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_hf_to_checkpoint_to_hf_keeps_the_logits(tmp_path, capsys, nproc):
    ids = token_ids()
    ref_model = save_hf("qwen2_shared_dense", tmp_path / "hf")
    ref = hf_logits(ref_model, ids)
    layout = ["--nproc", "2", "--set", "parallel.ep=2"] if nproc == 2 else []
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "run"), "--no-progress", *layout]) == 0
    assert "step_000000" in capsys.readouterr().out
    model = _load(tmp_path / "run")
    assert max_diff(our_logits(model, ids), ref) <= TOL
    assert cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--no-progress",
                     "--family", "qwen2_moe"]) == 0
    back = type(ref_model).from_pretrained(tmp_path / "out").eval()
    assert max_diff(hf_logits(back, ids), ref) <= TOL


def test_trained_checkpoint_exports_with_our_logits(tmp_path):
    """Three training steps of a Mixtral-shaped model (byte vocabulary), then export:
    transformers gives our logits and re-import gives the same parameters."""
    from moe_fold.models import from_hf
    from moe_fold.models.hf import hf_config
    from moe_fold.training.train import train

    save_hf("mixtral_gqa", tmp_path / "hf")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = load_config(None, [f"train.run_dir={tmp_path / 'run'}", f"data.path={text}",
                                f"data.cache_dir={tmp_path / 'cache'}", "model.seq_length=16", "train.steps=3",
                                "train.micro_batch_size=2", "train.global_batch_size=2", "train.save_every=3",
                                "optimizer.warmup_steps=1", "wandb.mode=disabled"])
    config = hf_config(tmp_path / "hf", config)
    config.model.vocab_size = 264  # the byte tokenizer's ids must fit
    train(config)
    assert latest_checkpoint(tmp_path / "run").name == "step_000003"
    model = _load(tmp_path / "run")
    untrained = build_model(config, ProcessGroups.single_process())
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), untrained.parameters()))
    assert cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--no-progress"]) == 0
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids() * 4
    assert max_diff(hf_logits(back, ids), our_logits(model, ids)) <= TOL
    for (name, p), q in zip(model.named_parameters(), from_hf(tmp_path / "out").parameters()):
        assert torch.equal(p, q), name


def test_refusals(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a Hugging Face folder" in capsys.readouterr().err
    save_hf("mixtral_gqa", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    assert "hidden_act='gelu'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_family_is_any_registered_family_and_checked_before_work(tmp_path, capsys):
    """``--family`` takes every family of the registry (deepseek_v3 among them), refuses one
    it does not know by listing them, refuses one that cannot hold the model with the
    family's reason, and means nothing when importing."""
    from moe_fold.models.hf.families import REGISTRY

    save_hf("mixtral_gqa", tmp_path / "hf")
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "run"), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "run2"), "--family", "mixtral"]) == 2
    assert "--family applies to moe-fold -> Hugging Face only" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--family", "mixtrall"]) == 2
    err = capsys.readouterr().err
    assert "--family=mixtrall" in err and all(name in err for name in REGISTRY)
    assert cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--family", "deepseek_v3"]) == 2
    assert "deepseek_v3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run2").exists()


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    assert "moe-fold convert hf/" in capsys.readouterr().out
