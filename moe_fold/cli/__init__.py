"""The ``moe-fold`` command: one subcommand per job, each defined in its own module of
this package (``moe_fold.cli.train``, ``moe_fold.cli.data``, ...).

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Those
modules are imported to build the parser, so they keep heavy imports (the model, the
training loop) inside ``run``: ``moe-fold layout`` never imports the training stack.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help). Modules are imported lazily.
COMMANDS: dict[str, tuple[str, str]] = {
    "layout": ("moe_fold.cli.layout", "print the attention and expert layouts of a world"),
    "data": ("moe_fold.cli.data", "turn text into a tokenized, memory-mapped dataset"),
    "plan": ("moe_fold.cli.plan", "estimate memory, FLOPs, communication, step time and MFU of a layout"),
    "dryrun": ("moe_fold.cli.dryrun", "build ranks of a job of any size with the real code, step once on meta "
                                      "tensors: memory by kind, every collective"),
    "train": ("moe_fold.cli.train", "train a model from a preset or YAML config (local ranks or torchrun)"),
    "convert": ("moe_fold.cli.convert", "convert between Hugging Face model folders and moe-fold checkpoints"),
    "checkpoint": ("moe_fold.cli.checkpoint", "verify checkpoints: files against the manifest, every expert present"),
    "sample": ("moe_fold.cli.sample", "generate text from a checkpoint (greedy or sampled, with a KV cache)"),
    "routes": ("moe_fold.cli.routes", "compare two runs' route traces: where their tokens' experts part"),
    "plot": ("moe_fold.cli.plot", "draw a run's loss, learning rate, grad norm, throughput and expert load as PNGs"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-fold",
        description="Pretrain Mixture-of-Experts language models with MoE parallel folding.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)
