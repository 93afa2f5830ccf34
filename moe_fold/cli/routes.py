"""Compare route traces (``train.route_trace_every``; docs/routes.md).

  diff RUN_A RUN_B [--step N]   per MoE layer, the fraction of tokens whose expert set
                                differs between the runs at each step both traced (or
                                step N), the first step and layer where they part, and
                                the tokens whose gating probabilities changed most.
                                Tokens are matched by sample and position, so runs of
                                different layouts compare. Exit status 0 when no token
                                is routed apart, 1 when some is, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  moe-fold routes diff runs/tp1 runs/tp2-ep2              # every step both runs traced
  moe-fold routes diff runs/fp32 runs/bf16 --step 10 --top 10
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    d = sub.add_parser("diff", help="where two runs' routes part")
    d.add_argument("run_a", help="a run folder with routes/step_*/")
    d.add_argument("run_b", help="another run of the same model and data")
    d.add_argument("--step", type=int, default=None, help="only this step (default: every step both traced)")
    d.add_argument("--top", type=int, default=5, help="how many tokens of largest probability change to list")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    from moe_fold.routes import diff, diff_json, format_diff

    try:
        result = diff(args.run_a, args.run_b, step=args.step, top=args.top)
    except (ValueError, FileNotFoundError) as e:
        print(f"moe-fold routes: error: {e}", file=sys.stderr)
        return 2
    print(diff_json(result) if args.json else format_diff(result))
    return 0 if result.first is None else 1
