"""Build ranks of a job of any size with the real code and run one training step on them,
on this machine, without allocating their tensors: memory by kind and every collective.

Each traced rank is built exactly as ``moe-fold train`` builds it (model, float32
masters, optimizer with its ZeRO-1 shards, gradient buckets, process groups of the whole
world) on meta tensors, under torch's fake process-group backend at the full world size,
and steps once: every micro-batch of the real pipeline schedule forward and backward,
then the optimizer. Routing, the one data-dependent quantity, follows --routing.
Memory is per kind (weights, grads, optimizer, activations: the most of each alive at
once) and the peak of all together; the collectives are listed in order in --json.
Layout options as in ``moe-fold plan``; moe_fold/training/dryrun.py says how it works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moe_fold.cli.plan import add_layout_arguments

EPILOG = """examples:
  moe-fold dryrun --config mixtral-8x22b --world 128
  moe-fold dryrun --config deepseek-v3 --world 1024 --routing starve-rank:3
  moe-fold dryrun --config mixtral-8x22b --world 128 --tp 2 --pp 8 --ep 8 --etp 1 --vpp 1 --ranks 0,127
  moe-fold dryrun --config qwen3-30b-a3b --world 8 --routing zipf:1.2 --json

Default ranks: for each pipeline stage, its first rank and its last ep rank.
Routing: balanced (default), one-expert (every token to the same top-k experts),
starve-rank:R (ep rank R receives no token), zipf:S (expert e drawn with weight 1/(e+1)^S).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--config", required=True, help="preset name or YAML path")
    parser.add_argument("--world", type=int, required=True, help="number of GPUs (ranks) of the job")
    add_layout_arguments(parser)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    parser.add_argument("--ranks", default=None, metavar="R,R,...",
                        help="ranks to trace (default: each pipeline stage's first and last ep rank)")
    parser.add_argument("--routing", default="balanced",
                        help="balanced | one-expert | starve-rank:R | zipf:S (default balanced)")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory the table checks against (default 80)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="worker processes tracing the ranks (default: the CPUs this process may use)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _ranks(text):
    if text is None:
        return None
    try:
        return [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks={text!r} must be comma-separated rank numbers, e.g. 0,7,127") from None


def run(args: argparse.Namespace) -> int:
    from moe_fold.config import ConfigError, load_config
    from moe_fold.dispatch.planned_routing import parse_routing
    from moe_fold.planner.estimate import with_layout
    from moe_fold.training.dryrun import dry_run

    try:
        config = load_config(args.config, args.set)
        config = with_layout(config, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                             mbs=args.mbs, gbs=args.gbs, seq=args.seq, recompute=args.recompute,
                             distributed=args.distributed_optimizer)
        routing = parse_routing(args.routing)
        ranks = _ranks(args.ranks)
        result = dry_run(config, args.world, ranks, routing, jobs=args.jobs)
    except (ConfigError, ValueError) as e:
        print(f"moe-fold dryrun: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result, args.gpu_gb)
    return 0


def _print(result: dict, gpu_gb: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False)
    console.width = max(console.width, 140)
    lay = result["layout"]
    console.print(f"world {result['world']}: attention tp {lay['tp']} x cp {lay['cp']} x dp {lay['dp']} x pp "
                  f"{lay['pp']} (vpp {lay['vpp']}); experts etp {lay['etp']} x ep {lay['ep']} x edp {lay['edp']} "
                  f"x pp {lay['pp']}; routing {result['routing']}")
    table = Table("rank", "stage", "tp", "ep", "params", "weights GB", "grads GB", "optimizer GB", "activations GB",
                  "peak GB", f"fits {gpu_gb:g} GB", "collectives", "bytes sent GB")
    for r in result["ranks"]:
        m = r["memory"]
        sent = sum(c["bytes"] for c in r["collectives"])
        table.add_row(str(r["rank"]), str(r["pp_stage"]), str(r["coords"]["tp"]), str(r["coords"]["ep"]),
                      f"{r['params']:,}", *(f"{m[k] / 1e9:.2f}" for k in ("weights", "grads", "optimizer",
                                                                          "activations", "peak")),
                      "yes" if m["peak"] <= gpu_gb * 1e9 else "[red]no[/red]", str(len(r["collectives"])),
                      f"{sent / 1e9:.2f}")
    console.print(table)
