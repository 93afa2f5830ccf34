"""``moe-fold plot`` (moe_fold/cli/plot.py): its errors, each exit 2 naming the file or
flag, before anything is drawn. The plots themselves are tests/training/test_plots.py."""

from __future__ import annotations

import json

from moe_fold.cli import main


def test_a_folder_without_metrics_exits_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-fold plot: error: {tmp_path / 'metrics.jsonl'} not found (RUN_DIR is the train.run_dir of a run)\n"
    assert not (tmp_path / "plots").exists()


def test_a_heatmap_of_a_run_without_moe_layers_exits_2(tmp_path, capsys):
    rows = [{"step": s, "loss": 2.0 - s / 10, "lm_loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
            for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path), "--heatmap"]) == 2
    assert "has no expert_load (a model without MoE layers)" in capsys.readouterr().err
