"""Convert between Hugging Face model folders and moe-fold checkpoints.

The direction follows INPUT:
  - a Hugging Face folder (config.json + safetensors of a family that
    docs/families/README.md lists) becomes a moe-fold checkpoint at OUTPUT/checkpoints/step_000000 (OUTPUT is a run
    folder; the checkpoint has config.yaml and no optimizer state);
  - a moe-fold checkpoint (a step_* folder with index.json, or a run folder: its newest
    checkpoint) becomes a Hugging Face folder at OUTPUT that transformers'
    from_pretrained loads, with the run's tokenizer (data.tokenizer, or --tokenizer) as
    tokenizer.json + tokenizer_config.json for AutoTokenizer, and generation_config.json.

Weights stream one tensor at a time: Hugging Face tensors are read slice by slice
straight into the model (never all loaded first), and the export gathers one parameter
at a time and writes safetensors shards as they fill. Peak memory: exporting, the model
plus one shard; importing, the model (the checkpoint writer streams from the live
tensors; pages of the memory-mapped Hugging Face files count in RSS while they are read
but are the system's to reclaim). With --nproc N the
work is split over N local ranks in the layout of --set parallel.* (e.g.
parallel.ep=N: each rank holds 1/N of the experts), which divides each process's memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EPILOG = """examples:
  moe-fold convert hf/Qwen3-30B-A3B runs/qwen3          # -> runs/qwen3/checkpoints/step_000000
  moe-fold convert hf/Mixtral-8x7B runs/mixtral --nproc 8 --set parallel.ep=8
  moe-fold convert runs/qwen3 exported/qwen3            # newest checkpoint -> Hugging Face folder
  moe-fold convert runs/tiny hf_out --tokenizer data/c/tokenizer.json   # the tokenizer moved since training
  moe-fold convert runs/tiny/checkpoints/step_000150 out/tiny --family qwen2_moe --max-shard-gb 2
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("input", help="a Hugging Face model folder, or a moe-fold checkpoint or run folder")
    parser.add_argument("output", help="the run folder to write the checkpoint into, or the Hugging Face folder")
    parser.add_argument("--config", default=None, metavar="FILE_OR_PRESET",
                        help="Hugging Face -> moe-fold: settings besides the architecture (default: defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override one config key, e.g. --set parallel.ep=4 (repeatable)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="local CPU ranks (gloo) to use (default 1)")
    parser.add_argument("--family", default=None, metavar="MODEL_TYPE",
                        help="moe-fold -> Hugging Face: the family to write, a model_type of "
                             "docs/families/README.md, e.g. qwen3_moe (default: inferred)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="moe-fold -> Hugging Face: largest safetensors file in GiB (default 5)")
    parser.add_argument("--tokenizer", default=None, metavar="SPEC",
                        help="moe-fold -> Hugging Face: the tokenizer to write, 'byte' or a tokenizer.json "
                             "(default: the checkpoint's data.tokenizer)")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")


def _direction(path: Path) -> str:
    if (path / "config.json").is_file():
        return "from_hf"
    if (path / "index.json").is_file() or (path / "checkpoints").is_dir():
        return "to_hf"
    raise ValueError(f"{path} is neither a Hugging Face folder (config.json) nor a moe-fold checkpoint "
                     f"(index.json) or run folder (checkpoints/)")


class _Bar:
    """A rich progress bar over parameter elements, or nothing."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     transient=True)
            self.task = self.progress.add_task(label, total=total)
            self.progress.start()

    def __call__(self, name: str, numel: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, numel)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def convert_from_hf(rank: int, world_size: int, source: str, run_dir: str, config, progress: bool) -> str:
    """One rank of Hugging Face -> checkpoint; returns the checkpoint path."""
    from moe_fold.training.checkpoint import save_checkpoint
    from moe_fold.models.hf import load_hf_into
    from moe_fold.models.model import build_model
    from moe_fold.training.train import build_groups

    groups = build_groups(config)
    model = build_model(config, groups)
    bar = _Bar(sum(p.numel() for p in model.parameters()), "reading", progress and rank == 0)
    try:
        load_hf_into(model, source, groups, on_tensor=bar)
    finally:
        bar.close()
    # keep_last: never remove checkpoints the run folder already had.
    path = save_checkpoint(run_dir, 0, model, None, None, {"converted_from": os.path.abspath(source)}, groups,
                           keep_last=sys.maxsize, config=config)
    return str(path)


def convert_to_hf(rank: int, world_size: int, source: str, output: str, config, family, max_shard_bytes: int,
                  progress: bool) -> str:
    """One rank of checkpoint -> Hugging Face folder; returns the folder."""
    from moe_fold.training.checkpoint import load_checkpoint
    from moe_fold.models.hf import to_hf
    from moe_fold.models.model import build_model
    from moe_fold.training.train import build_groups

    groups = build_groups(config)
    model = build_model(config, groups)
    _refuse_missing_experts(Path(source))
    load_checkpoint(source, model, None, None, groups)
    bar = _Bar(sum(p.numel() for p in model.parameters()), "writing", progress and rank == 0)
    try:
        to_hf(model, output, family=family, groups=groups, max_shard_bytes=max_shard_bytes, on_tensor=bar)
    finally:
        bar.close()
    return output


def _refuse_missing_experts(checkpoint: Path) -> None:
    """A Hugging Face model needs every expert: name the missing ones before writing."""
    from moe_fold.training.checkpoint import CheckpointError
    from moe_fold.training.checkpoint_verify import verify_checkpoint

    report = verify_checkpoint(checkpoint, checksums=False)  # loading checks the sha256s
    if report.missing_experts:
        raise CheckpointError(f"{checkpoint} cannot be exported: {report.expert_message()}; "
                              f"`moe-fold checkpoint verify {checkpoint}` lists every problem")


def find_checkpoint(path: Path) -> Path:
    """``path`` when it is a checkpoint (``step_*`` with index.json), else the newest of the run folder ``path``."""
    from moe_fold.training.checkpoint import CheckpointError, latest_checkpoint

    if (path / "index.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no finished checkpoint (checkpoints/step_*/index.json)")
    return latest


def _check_layout(config, nproc: int) -> None:
    """``validate`` for the conversion's layout: one process ignores ``parallel.*``, and
    the batch sizes (nothing is trained) must not refuse a world they do not fit."""
    import copy

    from moe_fold.config import ParallelConfig, validate

    check = copy.deepcopy(config)
    if nproc == 1:
        check.parallel = ParallelConfig()
    check.train.micro_batch_size, check.train.global_batch_size = 1, nproc
    validate(check, nproc)


def _tokenizer_problem(spec: str, config, field: str) -> str | None:
    """Why the tokenizer ``spec`` cannot go with the model (it does not load, or has more
    ids than the model's vocabulary), or None."""
    from moe_fold.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec)
    except (OSError, ValueError) as e:
        return f"{field}={spec}: {e}"
    if tokenizer.vocab_size > config.model.vocab_size:
        return f"{field}={spec} has {tokenizer.vocab_size} ids, more than model.vocab_size={config.model.vocab_size}"
    return None


def run(args: argparse.Namespace) -> int:
    import warnings

    from moe_fold.training.checkpoint import CheckpointError
    from moe_fold.config import ConfigError, load_config
    from moe_fold.models.hf import HFConfigError, HFWeightError, hf_config
    from moe_fold.models.hf.families import REGISTRY

    def fail(message: str) -> int:
        print(f"moe-fold convert: error: {message}", file=sys.stderr)
        return 2

    source = Path(args.input)
    if args.nproc < 1:
        return fail(f"--nproc={args.nproc} must be >= 1")
    if not args.max_shard_gb > 0:
        return fail(f"--max-shard-gb={args.max_shard_gb} must be > 0")
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        direction = _direction(source)
        if direction == "from_hf":
            base = load_config(args.config, args.overrides)
            if args.family is not None:
                return fail("--family applies to moe-fold -> Hugging Face only; the Hugging Face folder's "
                            "config.json names its family")
            if args.tokenizer is not None:
                return fail("--tokenizer applies to moe-fold -> Hugging Face only; the Hugging Face folder's "
                            "tokenizer.json comes with it")
            config = hf_config(source, base)
            _check_layout(config, args.nproc)
            work, work_args = convert_from_hf, (str(source), args.output, config, progress)
        else:
            if args.config is not None:
                return fail("--config applies to Hugging Face -> moe-fold only; the checkpoint has its config.yaml")
            if args.family is not None and args.family not in REGISTRY:
                return fail(f"--family={args.family} is not a family moe-fold writes; it writes "
                            f"{', '.join(REGISTRY)}")
            checkpoint = find_checkpoint(source)
            config = load_config(checkpoint / "config.yaml", args.overrides)
            _check_layout(config, args.nproc)
            tokenizer = args.tokenizer or config.data.tokenizer
            problem = _tokenizer_problem(tokenizer, config, "--tokenizer" if args.tokenizer else "data.tokenizer")
            if problem is not None and args.tokenizer:
                return fail(problem)
            if problem is not None:
                # A model imported without a tokenizer keeps the default data.tokenizer=byte,
                # which need not be its own: export the model and say why no tokenizer came.
                print(f"moe-fold convert: warning: no tokenizer written ({problem}); name the model's tokenizer "
                      f"with --tokenizer", file=sys.stderr)
                tokenizer = None
            work = convert_to_hf
            work_args = (str(checkpoint), args.output, config, args.family, int(args.max_shard_gb * 2**30), progress)
        if args.nproc == 1:
            with warnings.catch_warnings():
                # A checkpoint saved under another layout restores no random states: irrelevant here.
                warnings.simplefilter("ignore")
                out = work(0, 1, *work_args)
        else:
            from moe_fold.launch import RankError, run_ranks

            try:
                out = run_ranks(work, args.nproc, *work_args, timeout=7 * 24 * 3600.0)[0]
            except RankError as e:
                return fail(f"conversion failed: {e}")
        if direction == "to_hf" and tokenizer is not None:
            from moe_fold.data.hf_tokenizer import write_hf_tokenizer
            from moe_fold.models.hf import write_generation_config

            special_ids = write_hf_tokenizer(tokenizer, out, config.model.seq_length)
            write_generation_config(out, special_ids)
    except (ConfigError, HFConfigError, HFWeightError, CheckpointError, OSError, ValueError) as e:
        return fail(str(e))
    print(f"wrote {out}")
    return 0
