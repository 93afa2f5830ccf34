"""Print the attention and expert layouts of a world: each rank's coordinates and every group.

Attention layers run on tp x cp x dp x pp = world; expert layers on etp x ep x edp x pp
= world over the same ranks (MoE parallel folding). The order string says which size
varies fastest over consecutive ranks (leftmost first), as in Megatron-Core.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  moe-fold layout --world 8 --tp 2 --ep 4            # etp defaults to tp
  moe-fold layout --world 8 --tp 2 --ep 4 --etp 1    # experts without tensor parallel
  moe-fold layout --world 16 --tp 2 --cp 2 --pp 2 --ep 4 --etp 1
  moe-fold layout --world 8 --tp 2 --ep 2 --order ep-tp-cp-dp-pp

An impossible layout prints the rule it breaks and exits with code 2.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (default 1)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    parser.add_argument("--order", default="tp-cp-ep-dp-pp",
                        help="rank order, leftmost varies fastest (default tp-cp-ep-dp-pp)")


def _group_text(group: list[int]) -> str:
    return "{" + ",".join(str(r) for r in group) + "}"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from moe_fold.layout import ParallelLayout

    try:
        layout = ParallelLayout(args.world, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep,
                                etp=args.etp, order=args.order)
    except ValueError as e:
        print(f"moe-fold layout: error: {e}", file=sys.stderr)
        return 2

    console = Console(file=sys.stdout, highlight=False)
    s = layout.sizes
    console.print(f"world {layout.world_size}, order {layout.order}")
    sections = [
        ("attention", f"tp {s['tp']} x cp {s['cp']} x dp {s['dp']} x pp {s['pp']}",
         ("tp", "cp", "dp", "pp"), ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_dp_cp")),
        ("expert", f"etp {s['etp']} x ep {s['ep']} x edp {s['edp']} x pp {s['pp']}",
         ("etp", "ep", "edp", "pp"), ("etp", "ep", "edp", "pp", "etp_ep")),
    ]
    for name, product, coords, kinds in sections:
        # titles go on their own line: a table title wraps at the table's (narrow) width
        console.print(f"\n[bold]{name} layout[/bold]: {product} = {layout.world_size}")
        ranks = Table()
        ranks.add_column("rank", justify="right")
        for c in coords:
            ranks.add_column(c, justify="right")
        for rank in range(layout.world_size):
            coord = layout.coords(rank)
            ranks.add_row(str(rank), *(str(coord[c]) for c in coords))
        console.print(ranks)

        console.print(f"[bold]{name} groups[/bold]")
        groups = Table()
        groups.add_column("kind")
        groups.add_column("size", justify="right")
        groups.add_column("groups")
        for kind in kinds:
            gs = layout.groups(kind)
            groups.add_row(kind, str(len(gs[0])), " ".join(_group_text(g) for g in gs))
        console.print(groups)
    return 0
