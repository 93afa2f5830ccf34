"""Turn text into a tokenized, memory-mapped dataset (PREFIX.bin + PREFIX.idx) for training.

Inputs are text files, folders (searched recursively for the --ext extensions) and JSONL
files (one document per line, the text under --text-key). A text file is one document;
every document ends with the tokenizer's end-of-document token. The tokenizer is the
byte tokenizer (no file needed), a Hugging Face tokenizer.json, or a byte-level BPE
trained on the inputs with --train-bpe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """examples:
  moe-fold data notes/ --output data/notes                    # byte tokenizer
  moe-fold data corpus.jsonl --text-key content --output data/corpus
  moe-fold data books/ --train-bpe 8192 --output data/books   # writes data/books.tokenizer.json
  moe-fold data wiki/ --tokenizer tokenizer.json --output data/wiki
  moe-fold data --demo --output data/demo                     # the Python standard library's source

Train on it with --set data.path=data/notes (and data.tokenizer=... when not byte).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moe_fold.data.documents import DEFAULT_EXTENSIONS

    parser.epilog = EPILOG
    parser.add_argument("inputs", nargs="*", help="text/JSONL files or folders")
    parser.add_argument("--output", "-o", required=True, help="dataset prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a path to a tokenizer.json")
    parser.add_argument("--train-bpe", type=int, metavar="VOCAB", default=None,
                        help="train a byte-level BPE of this vocabulary size on the inputs, save it as "
                             "PREFIX.tokenizer.json and use it")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text (default text)")
    parser.add_argument("--ext", nargs="+", default=list(DEFAULT_EXTENSIONS),
                        help=f"extensions read from folders (default {' '.join(DEFAULT_EXTENSIONS)})")
    parser.add_argument("--demo", action="store_true",
                        help="use the demo corpus (the standard library's .py files) as input")
    parser.add_argument("--demo-max-bytes", type=int, default=None, help="size cap of the demo corpus (default 8 MiB)")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")


def run(args: argparse.Namespace) -> int:
    from moe_fold.data.corpus import DEMO_MAX_BYTES, demo_corpus_files
    from moe_fold.data.preprocess import build_dataset
    from moe_fold.data.tokenizer import load_tokenizer, train_bpe

    def fail(message: str) -> int:
        print(f"moe-fold data: error: {message}", file=sys.stderr)
        return 2

    if Path(args.output).is_dir() or args.output.endswith(("/", "\\")):
        return fail(f"--output {args.output} is a folder; give a prefix such as {Path(args.output) / 'data'} "
                    f"(writes PREFIX.bin and PREFIX.idx)")
    if args.train_bpe is not None and args.tokenizer != "byte":
        return fail("--train-bpe and --tokenizer are exclusive: --train-bpe makes the tokenizer")
    inputs = list(args.inputs)
    try:
        if args.demo:
            inputs += demo_corpus_files(args.demo_max_bytes or DEMO_MAX_BYTES)
        if not inputs:
            return fail("no inputs: give text/JSONL files or folders, or --demo")
        if args.train_bpe is not None:
            out = Path(f"{args.output}.tokenizer.json")
            tokenizer = train_bpe(inputs, args.train_bpe, out, text_key=args.text_key, extensions=args.ext)
            print(f"trained BPE tokenizer: vocab {tokenizer.vocab_size} -> {out}")
        else:
            tokenizer = load_tokenizer(args.tokenizer)
        summary = build_dataset(inputs, tokenizer, args.output, text_key=args.text_key, extensions=args.ext,
                                progress=not args.no_progress and sys.stderr.isatty())
    except (OSError, ValueError) as e:
        return fail(str(e))
    per_s = summary.input_bytes / max(summary.seconds, 1e-9) / 1e6
    print(f"wrote {summary.prefix}.bin/.idx: {summary.files} files, {summary.documents} documents, "
          f"{summary.tokens} tokens (vocab {tokenizer.vocab_size}, tokenizer {tokenizer.spec}), "
          f"{summary.seconds:.2f} s ({per_s:.1f} MB/s)")
    if summary.skipped_empty:
        print(f"skipped {summary.skipped_empty} empty documents")
    return 0
