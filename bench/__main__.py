"""``python -m bench``: the benchmark suite, from the repository root. Every benchmark in
bench/ runs at a small size, each beside its baseline measured in the same run; the suite
writes bench/results/<date>.jsonl, PNG plots next to it, and prints a table.

bench/ is a folder of scripts in the checkout, not part of the installed package. Each
benchmark also runs alone with its own flags: ``python bench/gemm.py --help``.
"""

import argparse
import sys
from pathlib import Path

from bench import suite

EPILOG = """examples:
  python -m bench                       # every benchmark, a few minutes on a small CPU box
  python -m bench --quick               # fewer cases, smaller sizes
  python -m bench --only gemm,permute   # just these benchmarks
  python -m bench --list                # the cases and their flags, without running them
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help="comma list of benchmarks to run (default: all; --list shows them)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size",
                      help="fewer cases and smaller sizes (same as --size quick)")
    size.add_argument("--size", choices=suite.SIZES,
                      help="smoke (seconds per benchmark, to check the plumbing), quick, or full (default)")
    parser.set_defaults(size="full")  # once for both flags: each would set its own default
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="JSON lines file to write (default: bench/results/<UTC date and time>.jsonl)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one benchmark invocation may take before it is stopped (default 600)")
    parser.add_argument("--list", action="store_true", help="print the cases and their flags, run nothing")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return suite.run(parser.parse_args(argv), Path(__file__).resolve().parent.parent)


if __name__ == "__main__":
    sys.exit(main())
