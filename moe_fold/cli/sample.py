"""Generate text from a checkpoint: greedy, or temperature / top-k / top-p sampling.

RUN_OR_CHECKPOINT is a run folder (its newest checkpoint) or a checkpoints/step_*
folder. The prompt is encoded with the run's tokenizer (data.tokenizer, or --tokenizer)
after an end-of-document token, as every document starts in training; generation stops
at --max-new-tokens or when the model ends the document. Tokens are printed as they come.

Sampling keeps a KV cache: the prompt runs once, then each step runs one token (the MoE
layers route the new token only). The experts run dropless (moe.capacity_factor is
ignored, as in Hugging Face's models). --nproc N runs N local ranks in the layout of the
checkpoint's config and --set parallel.* (tp, ep, etp, dp replicas, pp and vpp; not cp;
one process ignores parallel.*); every layout gives the same tokens for the same --seed.
"""

from __future__ import annotations

import argparse
import copy
import sys

EPILOG = """examples:
  moe-fold sample runs/mixtral-tiny --prompt "def main("
  moe-fold sample runs/mixtral-tiny --prompt "import " --temperature 0.8 --top-k 40 --seed 1
  moe-fold sample runs/mixtral-tiny/checkpoints/step_000200 --prompt "class " --top-p 0.9 --temperature 1
  moe-fold sample runs/mixtral-tiny --prompt "for " --nproc 2 --set parallel.ep=2
  moe-fold sample runs/mixtral-tiny --prompt "for " --nproc 2 --set parallel.tp=2 --set parallel.sequence_parallel=true
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run folder or a checkpoints/step_* folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: sample from softmax(logits / temperature)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the most likely tokens that hold probability P (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--tokenizer", default=None, metavar="SPEC",
                        help="'byte' or a tokenizer.json (default: the checkpoint's data.tokenizer)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="local CPU ranks (gloo) to use (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a config key, e.g. --set parallel.ep=2 (repeatable)")


def sampling_problems(args: argparse.Namespace, config) -> list[str]:
    """Everything ``moe-fold sample`` cannot run, each naming the field, value and rule."""
    from moe_fold.config import ConfigError, validate

    problems = []
    if args.nproc < 1:
        problems.append(f"--nproc={args.nproc} must be >= 1")
    if args.max_new_tokens < 0:
        problems.append(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if not args.temperature >= 0:
        problems.append(f"--temperature={args.temperature} must be >= 0 (0: greedy)")
    if args.top_k < 0:
        problems.append(f"--top-k={args.top_k} must be >= 0 (0: all tokens)")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p={args.top_p} must be in (0, 1]")
    p = config.parallel
    if p.cp > 1 or p.dynamic_cp:
        problems.append(f"parallel.cp={p.cp}{' with parallel.dynamic_cp=true' if p.dynamic_cp else ''}: sampling "
                        f"runs without context parallel (each step has one new token per sequence); "
                        f"use parallel.cp=1")
    if problems or args.nproc < 1:
        return problems
    # The layout alone: nothing is trained, so no batch size may refuse the world.
    check = copy.deepcopy(config)
    check.train.micro_batch_size, check.train.global_batch_size = 1, args.nproc
    try:
        validate(check, args.nproc)
    except ConfigError as e:
        problems.extend(e.problems)
    return problems


def sample_config(config, nproc: int):
    """The config the sampling model is built from: one process ignores ``parallel.*``
    (the layout the checkpoint was trained in); the experts run dropless."""
    from moe_fold.config import ParallelConfig

    config = copy.deepcopy(config)
    if nproc == 1:
        config.parallel = ParallelConfig()
    config.moe.capacity_factor, config.moe.pad_to_capacity = None, False
    return config


def sample_on_rank(rank: int, world_size: int, checkpoint: str, config, prompt: list[int], options: dict,
                   tokenizer_spec: str, stream: bool) -> list[int]:
    """One rank of sampling; returns the new tokens (rank 0 prints them as they come)."""
    import warnings

    import torch

    from moe_fold.data.tokenizer import load_tokenizer
    from moe_fold.models.model import build_model
    from moe_fold.models.sampling import generate
    from moe_fold.training.checkpoint import load_checkpoint
    from moe_fold.training.train import build_groups

    groups = build_groups(config)
    model = build_model(config, groups)
    with warnings.catch_warnings():
        # A checkpoint saved under another layout restores no random states: irrelevant here.
        warnings.simplefilter("ignore")
        load_checkpoint(checkpoint, model, None, None, groups)
    tokenizer = load_tokenizer(tokenizer_spec)
    printer = _Printer(tokenizer) if stream and rank == 0 else None
    tokens = generate(model, torch.tensor([prompt]), options["max_new_tokens"], temperature=options["temperature"],
                      top_k=options["top_k"], top_p=options["top_p"], seed=options["seed"],
                      stop_id=tokenizer.eod_id, vocab_limit=tokenizer.vocab_size,
                      on_token=None if printer is None else printer)
    if printer is not None:
        printer.finish()
    return tokens[0].tolist()


class _Printer:
    """Prints the decoded text as tokens come, holding back a cut multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def __call__(self, token) -> None:
        self.ids.append(int(token[0]))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # the rest of a character is still to come
            return
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        sys.stdout.write(text[self.shown:] + "\n")
        sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moe_fold.cli.convert import find_checkpoint
    from moe_fold.config import ConfigError, load_config
    from moe_fold.data.hf_tokenizer import prompt_ids
    from moe_fold.data.tokenizer import load_tokenizer
    from moe_fold.training.checkpoint import CheckpointError

    def fail(message: str) -> int:
        print(f"moe-fold sample: error: {message}", file=sys.stderr)
        return 2

    try:
        checkpoint = find_checkpoint(Path(args.checkpoint))
        config = sample_config(load_config(checkpoint / "config.yaml", args.overrides), args.nproc)
        problems = sampling_problems(args, config)
        if problems:
            return fail("\n  - ".join(["cannot sample:"] + problems))
        spec = args.tokenizer or config.data.tokenizer
        try:
            tokenizer = load_tokenizer(spec)
        except (OSError, ValueError) as e:
            field = "--tokenizer" if args.tokenizer else "data.tokenizer"
            return fail(f"{field}={spec}: {e} (name the run's tokenizer with --tokenizer)")
        if tokenizer.vocab_size > config.model.vocab_size:
            return fail(f"tokenizer {spec} has {tokenizer.vocab_size} ids, more than model.vocab_size="
                        f"{config.model.vocab_size}")
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        return fail(str(e))
    prompt = prompt_ids(tokenizer, args.prompt)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed)
    work_args = (str(checkpoint), config, prompt, options, spec, True)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    if args.nproc == 1:
        sample_on_rank(0, 1, *work_args)
        return 0
    from moe_fold.launch import RankError, run_ranks

    try:
        run_ranks(sample_on_rank, args.nproc, *work_args, timeout=24 * 3600.0)
    except RankError as e:
        return fail(f"sampling failed: {e}")
    return 0
