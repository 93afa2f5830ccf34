"""``python -m bench``: the benchmark suite, run from the repository root (see bench/suite.py)."""

import argparse
import sys
from pathlib import Path

from bench import suite
from moe_fold.cli import bench as bench_command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=bench_command.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_command.add_arguments(parser)
    return suite.run(parser.parse_args(argv), Path(__file__).resolve().parent.parent)


if __name__ == "__main__":
    sys.exit(main())
