"""`moe-fold train --set init.from_hf=PATH` takes the architecture from the Hugging Face
folder, whatever the preset says, and keeps the preset's layout, data and training."""

from __future__ import annotations

import dataclasses

from moe_fold import cli
from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models import to_hf
from moe_fold.models.model import build_model
from moe_fold.training.train import read_metrics


def test_cli_trains_from_an_hf_folder_of_another_shape(tmp_path):
    # A model unlike mixtral-tiny (width, depth, heads, experts) exported as an HF folder.
    source = load_config("mixtral-tiny", [
        "model.hidden_size=48", "model.num_layers=1", "model.num_heads=6", "model.num_kv_heads=3",
        "model.ffn_hidden_size=40", "moe.ffn_hidden_size=40", "moe.num_experts=4",
    ])
    to_hf(build_model(source, ProcessGroups.single_process()), tmp_path / "hf")

    run_dir = tmp_path / "run"
    code = cli.main([
        "train", "--config", "mixtral-tiny", "--no-progress",
        "--set", f"init.from_hf={tmp_path / 'hf'}", "--set", f"train.run_dir={run_dir}",
        "--set", "train.steps=2", "--set", "train.save_every=1000", "--set", "wandb.mode=disabled",
        "--set", "model.seq_length=32", "--set", "train.micro_batch_size=2",
        "--set", "train.global_batch_size=4", "--set", f"data.cache_dir={tmp_path / 'cache'}",
        "--set", "parallel.ep=1", "--set", "optimizer.warmup_steps=1",
    ])
    assert code == 0
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    saved = load_config(str(next(run_dir.glob("checkpoints/step_*/config.yaml"))))
    assert dataclasses.astuple(saved.model)[:5] == (source.model.vocab_size, 48, 1, 6, 3)
    assert saved.moe.num_experts == 4
