"""Draw a run's curves from its metrics.jsonl as PNGs in RUN_DIR/plots/.

loss.png (train objective and LM loss, and the validation loss when the file has
valid_loss rows), lr.png, grad_norm.png, tokens_per_s.png, dropped_fraction.png and
expert_load.png (each MoE layer's busiest expert over its mean, over steps); with
--heatmap, the expert-load heatmap of the last step (or --step N) too. Training writes
the same plots when it ends.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  moe-fold plot runs/mixtral-tiny
  moe-fold plot runs/mixtral-tiny --heatmap --step 100
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    parser.add_argument("--heatmap", action="store_true",
                        help="also draw the expert-load heatmap of one step into RUN_DIR/plots/")
    parser.add_argument("--step", type=int, default=None, help="the heatmap's step (default: the last)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moe_fold.training.plots import moe_layer_ids, read_metrics_rows, write_heatmap, write_run_plots

    def fail(message: str) -> int:
        print(f"moe-fold plot: error: {message}", file=sys.stderr)
        return 2

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        return fail(f"{run_dir / 'metrics.jsonl'} not found (RUN_DIR is the train.run_dir of a run)")
    try:
        written = write_run_plots(run_dir)
        if args.heatmap:
            loads = {r["step"]: r["expert_load"] for r in read_metrics_rows(run_dir) if r.get("expert_load")}
            if not loads:
                return fail(f"{run_dir / 'metrics.jsonl'} has no expert_load (a model without MoE layers)")
            step = max(loads) if args.step is None else args.step
            if step not in loads:
                return fail(f"--step={step} is not in {run_dir / 'metrics.jsonl'} (steps {min(loads)}..{max(loads)})")
            written.append(write_heatmap(run_dir / "plots" / f"expert_load_step{step:07d}.png", loads[step], step,
                                         moe_layer_ids(run_dir)))
    except (OSError, ValueError, KeyError) as e:
        return fail(str(e))
    for path in written:
        print(f"wrote {path}")
    return 0
