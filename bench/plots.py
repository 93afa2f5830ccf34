"""The suite's plots (matplotlib, PNG), drawn from the records of one run:

- ``dispatch_ep``: round-trip time and bytes per rank against the EP size (dropless,
  balanced routing, one line per dispatcher);
- ``gemm_efficiency``: grouped GEMM ``ratio_to_dense`` against tokens per expert;
- ``dispatch_skew``: round-trip time against the expert load skew, measured as the busiest
  rank's rows over the mean rank's (dropless, no ETP).

The ``*_series`` functions pick the points (plain data, no matplotlib); ``write_plots``
draws them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _of(records: list[dict], bench: str) -> list[dict]:
    return [r for r in records if r["bench"] == bench and "error" not in r]


def dispatch_ep_series(records: list[dict]) -> dict[str, list[tuple[int, float, int, int]]]:
    """``dispatcher -> [(ep, ms, bytes_sent, bytes_min)]`` sorted by ep."""
    series = defaultdict(list)
    for r in _of(records, "dispatch"):
        if r["mode"] == "dropless" and r["routing"] == "balanced":
            series[r["dispatcher"]].append((r["ep"], r["ms"], r["bytes_sent"], r["bytes_min"]))
    return {k: sorted(v) for k, v in series.items()}


def gemm_series(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """``"backend routing" -> [(tokens per expert, ratio_to_dense)]`` sorted by tokens."""
    series = defaultdict(list)
    for r in _of(records, "gemm"):
        series[f"{r['backend']} {r['routing']}"].append((r["tokens_per_expert_mean"], r["ratio_to_dense"]))
    return {k: sorted(v) for k, v in series.items()}


def skew_series(records: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """``"dispatcher epN" -> [(max / mean rows per rank, ms, routing label)]`` sorted by skew.

    Dropless without ETP, every rank's rows together are ``tokens * topk`` per rank, so
    that is the mean rank's load."""
    series = defaultdict(list)
    for r in _of(records, "dispatch"):
        if r["mode"] == "dropless" and r["etp"] == 1:
            label = r["routing"] + (f" s={r['zipf_s']:g}" if r.get("zipf_s") is not None else "")
            skew = r["rows_per_rank_max"] / (r["tokens"] * r["topk"])
            series[f"{r['dispatcher']} ep{r['ep']}"].append((skew, r["ms"], label))
    return {k: sorted(v) for k, v in series.items()}


def write_plots(records: list[dict], prefix: Path) -> tuple[list[Path], dict[str, str]]:
    """Draw every plot that has data to ``<prefix>_<name>.png``; returns the paths written
    and, for the plots not drawn, why. Raises ImportError naming the fix without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("matplotlib is not installed (pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written, missing = [], {}

    def save(fig, name):
        path = Path(f"{prefix}_{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    ep = {k: v for k, v in dispatch_ep_series(records).items() if len(v) > 1}
    if ep:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for name, points in ep.items():
            eps = [p[0] for p in points]
            left.plot(eps, [p[1] for p in points], "o-", label=name)
            line, = right.plot(eps, [p[2] / 1024 for p in points], "o-", label=f"{name} sent")
            right.plot(eps, [p[3] / 1024 for p in points], "x:", color=line.get_color(), label=f"{name} minimum")
        left.set(xlabel="EP size", ylabel="dispatch + combine, ms", title="round trip (balanced, dropless)")
        right.set(xlabel="EP size", ylabel="KiB per rank", title="bytes sent vs least possible")
        for ax in (left, right):
            ax.set_xticks(sorted({p[0] for v in ep.values() for p in v}))
            ax.legend(fontsize=8)
        save(fig, "dispatch_ep")
    else:
        missing["dispatch_ep"] = "no dropless balanced dispatch records at two or more EP sizes"

    def line_plot(name, series, missing_reason, annotate=False, **axes):
        """One ``o-`` line per series of (x, y[, label]) points, or the reason it is missing."""
        if not series:
            missing[name] = missing_reason
            return None
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
            if annotate:
                for x, y, text in points:
                    ax.annotate(text, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set(**axes)
        ax.legend(fontsize=8)
        return fig, ax

    gemm = line_plot("gemm_efficiency", gemm_series(records), "no gemm records",
                     xlabel="tokens per expert (mean)", ylabel="dense time / grouped time",
                     title="grouped GEMM efficiency (ratio_to_dense)")
    if gemm:
        fig, ax = gemm
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        save(fig, "gemm_efficiency")
    skew = line_plot("dispatch_skew", {k: v for k, v in skew_series(records).items() if len(v) > 1},
                     "no dropless dispatch records at two or more routings", annotate=True,
                     xlabel="busiest rank's rows / mean rank's rows", ylabel="dispatch + combine, ms",
                     title="expert load skew vs dispatch time (dropless)")
    if skew:
        save(skew[0], "dispatch_skew")
    return written, missing
