"""The pictures of a run (:mod:`moe_fold.training.plots`, ``moe-fold plot``): the
matplotlib figures are inspected (titles, axis labels, colour bar, the data of each
line and cell), and the PNGs written by the command and at the end of a run are real
images of a legible size."""

from __future__ import annotations

import json
import math

import matplotlib.image
import numpy as np
import pytest

from moe_fold.cli import main
from moe_fold.config import load_config
from moe_fold.training.plots import heatmap_figure, run_figures
from moe_fold.training.train import train


def _rows(steps: int = 6, valid_every: int = 0) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        load = [[10 * s, 20, 30, 40], [25, 25, 25, 25]]
        rows.append({"step": s, "loss": 5.0 / s, "lm_loss": 4.9 / s, "aux_loss": 1.0, "z_loss": 0.1,
                     "grad_norm": 1.0 + s, "lr": 1e-3 * s, "tokens_per_s": 1000.0 + s, "dropped_fraction": 0.01 * s,
                     "expert_load": load, "skipped": False, "loss_spike": False})
        if valid_every and s % valid_every == 0:
            rows.append({"step": s, "valid_loss": 6.0 / s, "valid_ppl": math.exp(6.0 / s)})
    return rows


def _lines(fig) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()
            if not line.get_label().startswith("_")}


def test_heatmap_has_axes_colour_bar_and_the_step():
    load = [[0, 10, 30, 40], [20, 20, 20, 20], [80, 0, 0, 0]]
    fig = heatmap_figure(load, step=120, layer_ids=[1, 3, 5])
    ax, bar = fig.axes  # the heatmap and its colour bar
    assert "step 120" in ax.get_title()
    assert ax.get_xlabel() == "expert" and ax.get_ylabel() == "MoE layer"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3", "5"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert "mean" in bar.get_ylabel()
    share = np.asarray(ax.get_images()[0].get_array())
    np.testing.assert_allclose(share, np.array(load) / np.array(load).mean(axis=1, keepdims=True))
    assert [t.get_text() for t in ax.texts][:4] == ["0", "10", "30", "40"]  # the counts, in the cells
    width, height = fig.get_size_inches() * fig.dpi
    assert width >= 600 and height >= 300


def test_run_figures_axes_and_data():
    rows = _rows(valid_every=2)
    figs = run_figures(rows, layer_ids=[0, 2])
    assert set(figs) == {"loss", "lr", "grad_norm", "tokens_per_s", "dropped_fraction", "expert_load"}
    loss = figs["loss"]
    assert loss.axes[0].get_xlabel() == "step" and "nats" in loss.axes[0].get_ylabel()
    lines = _lines(loss)
    assert lines["train loss (objective)"] == ([1, 2, 3, 4, 5, 6], [5.0 / s for s in range(1, 7)])
    assert lines["validation loss"] == ([2, 4, 6], [3.0, 1.5, 1.0])
    assert _lines(figs["lr"])["lr"][1] == pytest.approx([1e-3 * s for s in range(1, 7)])
    assert figs["grad_norm"].axes[0].get_yscale() == "log"
    assert _lines(figs["tokens_per_s"])["tokens_per_s"][1] == [1000.0 + s for s in range(1, 7)]
    load = _lines(figs["expert_load"])
    assert set(load) == {"layer 0", "layer 2"}
    assert load["layer 0"][1] == pytest.approx([max(10 * s, 40) / ((10 * s + 90) / 4) for s in range(1, 7)])
    assert load["layer 2"][1] == [1.0] * 6
    assert figs["expert_load"].axes[0].get_title().startswith("expert load imbalance")


def test_run_figures_without_validation_rows():
    lines = _lines(run_figures(_rows())["loss"])
    assert set(lines) == {"train loss (objective)", "train LM loss"}


def test_plot_command_writes_pngs(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(valid_every=3)))
    assert main(["plot", str(tmp_path), "--heatmap", "--step", "4"]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == sorted(["loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "dropped_fraction.png",
                            "expert_load.png", "expert_load_step0000004.png"])
    for name in names:
        image = matplotlib.image.imread(tmp_path / "plots" / name)
        assert image.shape[0] >= 300 and image.shape[1] >= 600 and image.std() > 0.05, name
    assert "wrote" in capsys.readouterr().out
    assert main(["plot", str(tmp_path), "--heatmap", "--step", "99"]) == 2
    assert "--step=99 is not in" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nowhere")]) == 2


def test_a_run_ends_with_its_plots_and_readable_heatmaps(tmp_path):
    config = load_config("mixtral-tiny", [
        "model.hidden_size=64", "model.num_layers=2", "model.seq_length=32", "moe.ffn_hidden_size=64",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=4", "train.save_every=1000",
        "optimizer.warmup_steps=1", "wandb.mode=disabled", "wandb.heatmap_every=2", "parallel.ep=1",
        f"train.run_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}"])
    result = train(config, progress=False)
    assert sorted(result.plots) == sorted(str(tmp_path / "plots" / f"{n}.png") for n in
                                          ("loss", "lr", "grad_norm", "tokens_per_s", "dropped_fraction",
                                           "expert_load"))
    heatmaps = sorted((tmp_path / "heatmaps").iterdir())
    assert [p.name for p in heatmaps] == ["expert_load_step0000002.png", "expert_load_step0000004.png"]
    image = matplotlib.image.imread(heatmaps[-1])
    assert image.shape[0] >= 300 and image.shape[1] >= 600
