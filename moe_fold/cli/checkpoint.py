"""Inspect moe-fold checkpoints.

  verify DIR   DIR is a checkpoint (a step_* folder with index.json) or a run folder (all
               its finished checkpoints, newest last). The manifest (index.json) is
               checked against its own sha256, then each file it lists: present, size,
               sha256. Then every expert of every
               MoE layer (model weights, and AdamW moments when saved) must be held by
               good files. Unfinished saves (step_*.tmp-*) are listed; resuming ignores
               them. Exit status 0 when every checkpoint is whole, 1 when one is damaged,
               2 when DIR holds no checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """examples:
  moe-fold checkpoint verify runs/mixtral-tiny                        # every checkpoint of the run
  moe-fold checkpoint verify runs/mixtral-tiny/checkpoints/step_000300
  moe-fold checkpoint verify runs/mixtral-tiny --no-checksums         # sizes only, fast
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = sub.add_parser("verify", help="check a checkpoint's files and experts against its manifest")
    verify.add_argument("dir", help="a checkpoint folder (step_*) or a run folder")
    verify.add_argument("--no-checksums", action="store_true",
                        help="check presence and sizes only, not sha256 (fast on large checkpoints)")


def _checkpoints(path: Path) -> tuple[list[Path], list[Path]]:
    """(finished checkpoints, unfinished save folders) of a checkpoint or run folder."""
    if (path / "index.json").is_file():
        return [path], []
    folder = path / "checkpoints"
    if not folder.is_dir():
        return [], []
    finished = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "index.json").is_file())
    unfinished = sorted(p for p in folder.iterdir() if p.is_dir() and not (p / "index.json").is_file())
    return finished, unfinished


def run(args: argparse.Namespace) -> int:
    from moe_fold.training.checkpoint_verify import verify_checkpoint

    path = Path(args.dir)
    finished, unfinished = _checkpoints(path)
    if not finished:
        print(f"moe-fold checkpoint: error: no checkpoint in {path}: neither {path / 'index.json'} nor "
              f"{path / 'checkpoints'}/step_*/index.json exists", file=sys.stderr)
        return 2
    damaged = 0
    for checkpoint in finished:
        report = verify_checkpoint(checkpoint, checksums=not args.no_checksums)
        damaged += not report.ok
        for line in report.lines():
            print(line)
    for folder in unfinished:
        print(f"{folder}: unfinished save (no index.json; resuming ignores it, the next save removes it)")
    print(f"{len(finished) - damaged} of {len(finished)} checkpoints whole" + (
        "" if not damaged else "; resume from a whole one (move the damaged ones away)"))
    return 1 if damaged else 0
