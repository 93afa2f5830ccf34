"""Run the benchmark suite of a moe-fold checkout: every benchmark in bench/ at a small size,
each beside its baseline measured in the same run; writes bench/results/<date>.jsonl,
PNG plots next to it, and prints a table.

bench/ is not installed with the package: run this from a checkout (the repository root or
any folder below it), or run ``python -m bench`` there, which takes the same flags. Each
benchmark also runs alone with its own flags: ``python bench/gemm.py --help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

EPILOG = """examples:
  moe-fold bench                       # every benchmark, a few minutes on a small CPU box
  moe-fold bench --quick               # fewer cases, smaller sizes
  moe-fold bench --only gemm,permute   # just these benchmarks
  moe-fold bench --list                # the cases and their flags, without running them
  python -m bench --quick              # the same, from the repository root
"""

SIZES = ("smoke", "quick", "full")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's flags; ``python -m bench`` builds its parser with this function too."""
    parser.epilog = EPILOG
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help="comma list of benchmarks to run (default: all; --list shows them)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size",
                      help="fewer cases and smaller sizes (same as --size quick)")
    size.add_argument("--size", choices=SIZES,
                      help="smoke (seconds per benchmark, to check the plumbing), quick, or full (default)")
    parser.set_defaults(size="full")  # once for both flags: each would set its own default
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="JSON lines file to write (default: bench/results/<UTC date and time>.jsonl)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one benchmark invocation may take before it is stopped (default 600)")
    parser.add_argument("--list", action="store_true", help="print the cases and their flags, run nothing")


def find_checkout(start: Path) -> Path:
    """The nearest folder at or above ``start`` that holds ``bench/suite.py``."""
    for folder in (start, *start.parents):
        if (folder / "bench" / "suite.py").is_file():
            return folder
    raise FileNotFoundError(
        f"moe-fold bench needs a moe-fold checkout: no bench/suite.py in {start} or any folder above it "
        "(bench/ is not installed with the package; run this from the repository root)")


def run(args: argparse.Namespace) -> int:
    try:
        root = find_checkout(Path.cwd().resolve())
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    suite = importlib.import_module("bench.suite")
    return suite.run(args, root)
