"""Pictures of a run, drawn with matplotlib (Agg: no display needed).

- :func:`heatmap_figure`: one step's expert load, MoE layers x experts, each cell the
  tokens an expert received as a share of its layer's mean (1 = perfectly balanced),
  with the token counts written in the cells when they fit; training writes one every
  ``wandb.heatmap_every`` steps to ``<run_dir>/heatmaps/``.
- :func:`run_figures` / :func:`write_run_plots`: curves over steps from ``metrics.jsonl``:
  loss (train, and validation where the file has ``valid_loss`` rows), learning rate,
  grad norm, tokens/s, dropped fraction, and each MoE layer's max/mean expert load.
  ``moe-fold plot RUN_DIR`` and the end of a run write them to ``<run_dir>/plots/``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["heatmap_figure", "write_heatmap", "read_metrics_rows", "run_figures", "write_run_plots",
           "moe_layer_ids"]

# Cells larger than this many get no numbers written in them: they would not be legible.
_ANNOTATE_MAX_CELLS = 256


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap_figure(load: Sequence[Sequence[float]], step: int, layer_ids: Optional[Sequence[int]] = None):
    """The expert-load heatmap of ``load [moe layers][experts]`` (tokens per expert) at
    ``step``; ``layer_ids`` names the rows (default 0, 1, ...). Returns the Figure."""
    import numpy as np

    plt = _pyplot()
    counts = np.asarray(load, dtype=float)  # [layers, experts]
    if counts.ndim != 2 or counts.size == 0:
        raise ValueError(f"expert load must be a non-empty [layers][experts] table, got shape {counts.shape}")
    layers, experts = counts.shape
    means = counts.mean(axis=1, keepdims=True)
    share = np.divide(counts, means, out=np.ones_like(counts), where=means > 0)  # [layers, experts]
    layer_ids = list(range(layers)) if layer_ids is None else list(layer_ids)
    # About half an inch per cell, at least room for the title and at most a screen.
    size = (min(16.0, max(6.4, 2.5 + 0.55 * experts)), min(12.0, max(3.5, 1.8 + 0.45 * layers)))
    fig, ax = plt.subplots(figsize=size, dpi=100, layout="constrained")
    # Centred on 1 (balanced): white, blue down to an idle expert (0), red up to the busiest.
    from matplotlib.colors import TwoSlopeNorm

    top = max(2.0, float(share.max()))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    image = ax.imshow(share, cmap="coolwarm", norm=norm, aspect="auto", interpolation="nearest")
    bar = fig.colorbar(image, ax=ax)
    bar.set_label("tokens / layer mean (1 = balanced)")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_xticks(range(0, experts, 1 if experts <= 64 else experts // 16))
    ax.set_yticks(range(layers), [str(i) for i in layer_ids])
    totals = counts.sum(axis=1)
    # Layers differ in total only when capacity dropped assignments; then the counts say it.
    each = f" ({int(totals[0]):,} token-expert assignments per layer)" if (totals == totals[0]).all() else ""
    ax.set_title(f"expert load at step {step}{each}")
    if layers * experts <= _ANNOTATE_MAX_CELLS:
        for r in range(layers):
            for e in range(experts):
                far = share[r, e] < 0.4 or share[r, e] > 1 + 0.6 * (top - 1)
                ax.text(e, r, f"{int(counts[r, e])}", ha="center", va="center", fontsize=8,
                        color="white" if far else "black")
    return fig


def write_heatmap(path: str | os.PathLike, load: Sequence[Sequence[float]], step: int,
                  layer_ids: Optional[Sequence[int]] = None) -> Path:
    """:func:`heatmap_figure` saved as a PNG at ``path`` (written whole, then renamed)."""
    return _save(heatmap_figure(load, step, layer_ids), Path(path))


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp)
    finally:
        plt.close(fig)
    os.replace(tmp, path)
    return path


def read_metrics_rows(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` (training and validation rows alike)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moe_layer_ids(run_dir: str | os.PathLike) -> Optional[list[int]]:
    """The model's MoE layer indices from ``<run_dir>/config.yaml`` (None without it)."""
    from moe_fold.config import load_config, moe_layer_flags

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    return [i for i, flag in enumerate(moe_layer_flags(load_config(path))) if flag]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows
              if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return [s for s, _ in points], [float(v) for _, v in points]


def _curve(title: str, ylabel: str, lines: list[tuple[str, list[int], list[float], str]], log: bool = False):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100, layout="constrained")
    for label, steps, values, style in lines:
        ax.plot(steps, values, style, label=label, linewidth=1.5, markersize=4)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if len(lines) > 1:
        ax.legend()
    return fig


def run_figures(rows: list[dict], layer_ids: Optional[Sequence[int]] = None) -> dict:
    """The curves of a run's ``metrics.jsonl`` rows: ``{name: Figure}`` for ``loss``,
    ``lr``, ``grad_norm``, ``tokens_per_s``, ``dropped_fraction`` and ``expert_load``
    (those the rows have data for)."""
    train = [r for r in rows if "loss" in r]
    figures = {}
    loss_lines = []
    for key, label, style in (("loss", "train loss (objective)", "-"), ("lm_loss", "train LM loss", "-")):
        steps, values = _series(train, key)
        if steps:
            loss_lines.append((label, steps, values, style))
    steps, values = _series(rows, "valid_loss")
    if steps:
        loss_lines.append(("validation loss", steps, values, "o-"))
    if loss_lines:
        figures["loss"] = _curve("loss", "cross-entropy (nats per token)", loss_lines)
    for key, title, ylabel, log in (("lr", "learning rate", "learning rate", False),
                                     ("grad_norm", "gradient norm (before clipping)", "L2 norm", True),
                                     ("tokens_per_s", "throughput", "tokens / s", False),
                                     ("dropped_fraction", "dropped token-expert assignments", "fraction", False)):
        steps, values = _series(train, key)
        if steps:
            figures[key] = _curve(title, ylabel, [(key, steps, values, "-")],
                                  log=log and all(v > 0 for v in values))
    load_rows = [r for r in train if r.get("expert_load")]
    if load_rows:
        layers = len(load_rows[0]["expert_load"])
        ids = list(range(layers)) if layer_ids is None else list(layer_ids)
        steps = [r["step"] for r in load_rows]
        lines = []
        for i in range(layers):
            ratio = []
            for r in load_rows:
                row = r["expert_load"][i]
                mean = sum(row) / len(row)
                ratio.append(max(row) / mean if mean > 0 else 1.0)
            lines.append((f"layer {ids[i]}", steps, ratio, "-"))
        fig = _curve("expert load imbalance: busiest expert / mean, per MoE layer", "max / mean tokens per expert",
                     lines)
        fig.axes[0].axhline(1.0, color="grey", linestyle=":", linewidth=1)
        figures["expert_load"] = fig
    return figures


def write_run_plots(run_dir: str | os.PathLike) -> list[Path]:
    """Draw :func:`run_figures` of ``<run_dir>/metrics.jsonl`` into ``<run_dir>/plots/NAME.png``;
    returns the files written."""
    run_dir = Path(run_dir)
    rows = read_metrics_rows(run_dir)
    figures = run_figures(rows, moe_layer_ids(run_dir))
    return [_save(fig, run_dir / "plots" / f"{name}.png") for name, fig in figures.items()]
