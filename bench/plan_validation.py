"""The planner against published measurements: predict every row of bench/published/*.csv.

Each row is one published training throughput (paper table or repository file, quoted in its
``source_ref`` column) with the layout it ran: GPU, world, tp/pp/vpp/ep/etp/cp, micro and
global batch, sequence, recompute, data-parallel overlap, attention kernel, precision. The
planner (:func:`moe_fold.planner.estimate.estimate`, shape model) predicts its step time,
and from it the row's own metric:

- ``tflops_recompute``: TFLOP/s per GPU counting the recomputed forward, as Megatron-LM 2019
  and 2021 count them (``96 B s l h^2 (1 + s/6h + V/16lh)``: four forward passes of every
  layer, three of the logits);
- ``model_tflops``: model TFLOP/s per GPU (no recompute), as Megatron-Core and
  Megatron-Bridge report them;
- ``mfu``: model FLOPs per second per GPU over the GPU's dense BF16 peak, in percent, as the
  MoE Parallel Folding paper reports it (its peak, 989.5 TFLOP/s on H100, is the hardware
  table's 989 within 0.05%).

All are FLOPs of the row's own convention over the same predicted step time, so the
relative error of the TFLOP/s is the relative error of the MFU. Each row also gets the
published and predicted MFU on model FLOPs (:func:`moe_fold.planner.model.model_flops_per_step`
over world x dense BF16 peak).

The kernel figures (:data:`moe_fold.planner.estimate.CALIBRATED_EFFICIENCY`, the large-GEMM
efficiency of each GPU, and ``CALIBRATED["elementwise_passes"]`` and
``CALIBRATED["gemm_k_overhead"]``, shared) are fitted only on the rows whose ``calibration``
column says ``yes`` (``--fit`` refits them there and prints them); every other row is held
out. The summary prints the error by GPU generation, held-out and calibration rows apart
(each generation has its own efficiency), then per source. Each row is planned by
:func:`moe_fold.planner.precedent.row_plan`, as ``moe-fold plan --row ID`` plans it: one MFU.

Rows become configs with :func:`moe_fold.planner.precedent.row_config` (GPT rows as dense
moe-fold models with the FLOPs of GPT's MLP).

    python bench/plan_validation.py            # the table and the summary
    python bench/plan_validation.py --fit      # refit the calibration figures first
    python bench/plan_validation.py --json     # one JSON line per row, then the summary
    python bench/plan_validation.py --flat 0.7 # the flat model the planner had before
    python bench/plan_validation.py --flat-fit # the flat model, fitted per GPU on the same rows
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from moe_fold.config import Config
from moe_fold.planner.estimate import (
    BORROWED_EFFICIENCY, CALIBRATED, CALIBRATED_EFFICIENCY, Assumptions, Plan,
)
from moe_fold.planner.hardware import get_gpu
from moe_fold.planner.model import dims, layer_forward_flops, model_flops_per_step
from moe_fold.planner.precedent import PUBLISHED, read_published as read_rows, row_config, row_plan
from moe_fold.planner.precedent import row_assumptions as precedent_assumptions
METRICS = ("tflops_recompute", "model_tflops", "mfu")
# The per-tile reduction overhead k0 the fit tries (elements of k; compute_time.gemm_seconds).
K_OVERHEAD_GRID = (0.0, 256.0, 512.0, 1024.0)


def row_assumptions(row: dict, kernels: dict) -> Assumptions:
    """The row's assumptions: its GPU's fitted efficiency, the shared element-wise passes,
    and what the row ran (overlap, attention kernel, GEMM dtype). ``kernels={"flat": e}``:
    the flat model at efficiency ``e`` instead (the planner before the shape model)."""
    if "flat" in kernels:
        e = kernels["flat"][row["gpu"]] if isinstance(kernels["flat"], dict) else kernels["flat"]
        return Assumptions(matmul_efficiency=e, overlap=row["dp_overlap"], implementation="megatron")
    return precedent_assumptions(row, matmul_efficiency=kernels["efficiency"][row["gpu"]],
                                 elementwise_passes=kernels["elementwise_passes"],
                                 gemm_k_overhead=kernels["gemm_k_overhead"])


def calibrated_kernels() -> dict:
    """The figures the planner ships (:data:`moe_fold.planner.estimate.CALIBRATED`)."""
    return {"efficiency": dict(CALIBRATED_EFFICIENCY), "elementwise_passes": CALIBRATED["elementwise_passes"],
            "gemm_k_overhead": CALIBRATED["gemm_k_overhead"]}


def metric_flops(config: Config, metric: str) -> float:
    """FLOPs per step in the row's convention (see the module doc)."""
    model = model_flops_per_step(config)
    if metric in ("model_tflops", "mfu"):
        return model
    if metric == "tflops_recompute":
        d = dims(config)
        layers = sum(sum(layer_forward_flops(config, i, float(d.topk)).values()) for i in range(d.layers))
        return model + config.train.global_batch_size * d.seq * layers
    raise ValueError(f"metric={metric!r} must be one of {', '.join(METRICS)}")


def predict(row: dict, kernels: Optional[dict] = None) -> dict:
    """One row's prediction: published and predicted metric and MFU, the error, the plan."""
    kernels = calibrated_kernels() if kernels is None else kernels
    config = row_config(row)
    gpu = get_gpu(row["gpu"])
    world = int(row["world"])
    plan: Plan = row_plan(row, row_assumptions(row, kernels))
    numerator = metric_flops(config, row["metric"])
    model = model_flops_per_step(config)
    published = float(row["published"])
    predicted = numerator / (world * plan.time["total"]) / 1e12
    to_mfu = model / numerator / (gpu.peak_flops / 1e12)
    if row["metric"] == "mfu":  # published in percent of the peak: predict the same
        predicted, to_mfu = predicted * to_mfu * 100, 0.01
    return {"id": row["id"], "source": row["source"], "gpu": row["gpu"], "precision": row["precision"],
            "world": world, "layout": f"tp{row['tp']} pp{row['pp']} vpp{row['vpp']} ep{row['ep']} etp{row['etp']} cp{row['cp']}",
            "metric": row["metric"], "published": published, "predicted": round(predicted, 2),
            "error": predicted / published - 1, "published_mfu": published * to_mfu,
            "predicted_mfu": plan.mfu, "fit": row["calibration"] == "yes", "fits_memory": plan.fits,
            "time": {k: round(v, 4) for k, v in plan.time.items()}}


def _errors(errors: list[float]) -> dict:
    if not errors:
        return {"rows": 0}
    return {"rows": len(errors), "median_abs_error": statistics.median(map(abs, errors)),
            "worst_abs_error": max(map(abs, errors)), "mean_error": statistics.mean(errors)}


def summary(results: list[dict]) -> dict:
    """Held-out error over all rows; per GPU generation (``by_gpu``: its held-out rows and,
    apart, its calibration rows: count, median and worst absolute error, mean error), since
    each generation has its own fitted efficiency; and per source (``by_source``, held-out)."""
    held = [abs(r["error"]) for r in results if not r["fit"]]
    by_gpu = {gpu: {"held_out": _errors([r["error"] for r in results if r["gpu"] == gpu and not r["fit"]]),
                    "calibration": _errors([r["error"] for r in results if r["gpu"] == gpu and r["fit"]])}
              for gpu in dict.fromkeys(r["gpu"] for r in results)}
    by_source = {}
    for source in dict.fromkeys(r["source"] for r in results if not r["fit"]):
        errors = [r["error"] for r in results if not r["fit"] and r["source"] == source]
        by_source[source] = {"rows": len(errors), "median_abs_error": statistics.median(map(abs, errors)),
                             "worst_abs_error": max(map(abs, errors)), "mean_error": statistics.mean(errors)}
    return {"rows": len(results), "sources": len({r["source"] for r in results}),
            "calibration_rows": sum(r["fit"] for r in results), "held_out_rows": len(held),
            "held_out_median_abs_error": statistics.median(held), "held_out_worst_abs_error": max(held),
            "held_out_mean_error": statistics.mean(r["error"] for r in results if not r["fit"]),
            "by_gpu": by_gpu, "by_source": by_source}


def fit(rows: list[dict], flat: bool = False) -> dict:
    """Fit on the calibration rows only: for each element-wise pass count on a grid, each
    GPU's efficiency minimises the squared log error of that GPU's calibration rows (golden
    section on [0.2, 1], 14 steps); the pass count with the least total wins. GPUs without a
    calibration row keep their shipped efficiency. ``flat``: the flat model's efficiency per
    GPU on the same rows instead (for comparison)."""
    import math

    calibration = [r for r in rows if r["calibration"] == "yes"]
    gpus = sorted({r["gpu"] for r in calibration})
    shipped = calibrated_kernels()

    def loss(gpu: str, e: float, passes: float, k0: float) -> float:
        kernels = {"efficiency": dict(shipped["efficiency"], **{gpu: e}), "elementwise_passes": passes,
                   "gemm_k_overhead": k0}
        if flat:
            kernels = {"flat": kernels["efficiency"]}
        return sum(math.log(1 + predict(r, kernels)["error"]) ** 2 for r in calibration if r["gpu"] == gpu)

    def best_efficiency(gpu: str, passes: float, k0: float) -> tuple[float, float]:
        lo, hi = 0.2, 1.0
        golden = (math.sqrt(5) - 1) / 2
        for _ in range(14):
            a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
            if loss(gpu, a, passes, k0) < loss(gpu, b, passes, k0):
                hi = b
            else:
                lo = a
        e = round((lo + hi) / 2, 3)
        return e, loss(gpu, e, passes, k0)

    best = None
    for k0 in [0.0] if flat else K_OVERHEAD_GRID:
        for passes in [0] if flat else range(0, 61, 10):
            fitted = {gpu: best_efficiency(gpu, passes, k0) for gpu in gpus}
            total = sum(l for _, l in fitted.values())
            if best is None or total < best[0]:
                best = (total, passes, k0, {gpu: e for gpu, (e, _) in fitted.items()})
    _, passes, k0, efficiency = best
    efficiency = dict(shipped["efficiency"], **efficiency)
    for gpu, source in BORROWED_EFFICIENCY.items():  # no published row of their own
        efficiency[gpu] = efficiency[source]
    if flat:
        return {"flat": efficiency}
    return {"efficiency": efficiency, "elementwise_passes": float(passes), "gemm_k_overhead": k0}


def table(results: list[dict]) -> str:
    head = (f"{'row':41} {'gpu':5} {'prec':5} {'world':>5} {'layout':29} {'metric':16} {'published':>9} "
            f"{'predicted':>9} {'error':>7} {'MFU pub':>7} {'MFU pred':>8} {'used':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['id']:41} {r['gpu']:5} {r['precision']:5} {r['world']:>5} {r['layout']:29} "
                     f"{r['metric']:16} {r['published']:>9.2f} {r['predicted']:>9.2f} {100 * r['error']:>+6.1f}% "
                     f"{100 * r['published_mfu']:>6.1f}% {100 * r['predicted_mfu']:>7.1f}% "
                     f"{'fit' if r['fit'] else 'held-out':>9}")
    return "\n".join(lines)


def gpu_table(by_gpu: dict, markdown: bool = False) -> str:
    """The error by GPU generation, held-out and calibration rows apart."""
    def cell(e: dict) -> list[str]:
        if not e["rows"]:
            return ["0", "", "", ""]
        return [str(e["rows"]), f"{100 * e['median_abs_error']:.1f}%", f"{100 * e['worst_abs_error']:.1f}%",
                f"{100 * e['mean_error']:+.1f}%"]
    head = ["GPU", "held-out rows", "median abs error", "worst", "mean", "calibration rows", "median abs error", "worst",
            "mean"]
    body = [[gpu.upper(), *cell(e["held_out"]), *cell(e["calibration"])] for gpu, e in by_gpu.items()]
    if markdown:
        return "\n".join("| " + " | ".join(line) + " |" for line in [head, ["---"] * len(head), *body])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *body])


def markdown(results: list[dict]) -> str:
    """The table as docs/planner.md shows it."""
    lines = ["| row | GPU | precision | GPUs | layout | metric | published | predicted | error | MFU published | "
             "MFU predicted | used |", "|" + " --- |" * 12]
    for r in results:
        lines.append(f"| {r['id']} | {r['gpu'].upper()} | {r['precision']} | {r['world']} | {r['layout']} | "
                     f"{r['metric']} | {r['published']:g} | {r['predicted']:.1f} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['published_mfu']:.1f}% | {100 * r['predicted_mfu']:.1f}% | "
                     f"{'fit' if r['fit'] else 'held out'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--published", type=Path, default=PUBLISHED, help="folder of the published CSVs")
    parser.add_argument("--fit", action="store_true", help="refit the kernel figures on the calibration rows")
    parser.add_argument("--flat", type=float, default=None, metavar="E",
                        help="predict with the flat model at efficiency E instead (the planner's old default: 0.7)")
    parser.add_argument("--flat-fit", action="store_true",
                        help="the flat model with its efficiency fitted per GPU on the calibration rows")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    parser.add_argument("--markdown", action="store_true", help="the table in Markdown (docs/planner.md)")
    args = parser.parse_args(argv)
    rows = read_rows(args.published)
    if args.flat_fit:
        kernels = fit(rows, flat=True)
    elif args.flat is not None:
        kernels = {"flat": args.flat}
    else:
        kernels = fit(rows) if args.fit else calibrated_kernels()
    results = [predict(r, kernels) for r in rows]
    out = dict(summary(results), kernels=kernels)
    if args.markdown:
        print(markdown(results))
        print()
        print(gpu_table(out["by_gpu"], markdown=True))
    elif args.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps(out))
    else:
        origin = ("flat model" if args.flat is not None or args.flat_fit else "refitted" if args.fit
                  else "moe_fold.planner.estimate.CALIBRATED")
        print(f"kernel figures ({origin}): {kernels}")
        print(table(results))
        print(gpu_table(out["by_gpu"]))
        print(f"all GPUs pooled (read the table above instead): {out['held_out_rows']} held-out rows of "
              f"{out['rows']} ({out['sources']} sources), median |error| {100 * out['held_out_median_abs_error']:.1f}%, "
              f"worst {100 * out['held_out_worst_abs_error']:.1f}%, mean error {100 * out['held_out_mean_error']:+.1f}%")
        for source, e in out["by_source"].items():
            print(f"  {source}: {e['rows']} held-out rows, median |error| {100 * e['median_abs_error']:.1f}%, "
                  f"worst {100 * e['worst_abs_error']:.1f}%, mean {100 * e['mean_error']:+.1f}%")
    return out


if __name__ == "__main__":
    main()
