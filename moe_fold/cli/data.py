"""Turn text into a tokenized, memory-mapped dataset (PREFIX.bin + PREFIX.idx) for
training, in moe-fold's format or Megatron-LM's; or inspect a tokenized dataset.

Inputs are text files, folders (searched recursively for the --ext extensions), JSONL
files (one document per line, the text under --text-key; .jsonl.gz and .jsonl.zst are
read as streams) and Parquet/Arrow files (one document per row). A text file is one
document; every document ends with the tokenizer's end-of-document token. The tokenizer
is the byte tokenizer (no file needed), a Hugging Face tokenizer.json, or a byte-level BPE
trained on the inputs with --train-bpe. --workers N tokenizes in N processes; the output
is the same bytes for any N.

`moe-fold data inspect PATH` reads any dataset data.path accepts (moe-fold, Megatron
MMIDIDX, .npy/.bin token files, Hugging Face datasets, Parquet) and prints its format,
size, document lengths, vocabulary coverage and first documents, after the checks
training makes before it starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EPILOG = """examples:
  moe-fold data notes/ --output data/notes                    # byte tokenizer
  moe-fold data corpus.jsonl --text-key content --output data/corpus
  moe-fold data books/ --train-bpe 8192 --output data/books   # writes data/books.tokenizer.json
  moe-fold data wiki/*.jsonl.zst --tokenizer tokenizer.json --workers 16 --output data/wiki
  moe-fold data wiki/ --tokenizer tokenizer.json --format megatron --output data/wiki_text_document
  moe-fold data --demo --output data/demo                     # the Python standard library's source
  moe-fold data inspect data/wiki                             # check a dataset before a long run
  moe-fold data inspect megatron/wiki_text_document --tokenizer tokenizer.json --vocab-size 32000

Train on it with --set data.path=data/notes (and data.tokenizer=... when not byte).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moe_fold.data.documents import DEFAULT_EXTENSIONS

    parser.epilog = EPILOG
    parser.add_argument("inputs", nargs="*", help="text/JSONL files or folders")
    parser.add_argument("--output", "-o", help="dataset prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--format", default="moefidx", choices=("moefidx", "megatron"),
                        help="output format: moe-fold's (default) or Megatron-LM's MMIDIDX")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizing processes (default 1); for BPE tokenizers: the byte tokenizer outruns the "
                             "cost of sending text to workers, keep it at 1")
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
    inspect = parser.add_argument_group("inspect (moe-fold data inspect PATH)")
    inspect.add_argument("--docs", type=int, default=3, help="documents to decode and print (default 3)")
    inspect.add_argument("--vocab-size", type=int, default=None,
                         help="the model's vocabulary, for formats that store none (default: the tokenizer's)")
    inspect.add_argument("--eod-id", type=int, default=None, help="end-of-document id (default: the tokenizer's)")
    inspect.add_argument("--dtype", default=None, help="token dtype of a raw .bin token file (e.g. uint16)")
    inspect.add_argument("--full", action="store_true", help="read every token (default: 8 blocks of 2^20)")


def run(args: argparse.Namespace) -> int:
    from moe_fold.data.corpus import DEMO_MAX_BYTES, demo_corpus_files
    from moe_fold.data.preprocess import build_dataset
    from moe_fold.data.tokenizer import load_tokenizer, train_bpe

    def fail(message: str) -> int:
        print(f"moe-fold data: error: {message}", file=sys.stderr)
        return 2

    if args.inputs[:1] == ["inspect"]:
        return _inspect(args, fail)
    if args.output is None:
        return fail("--output is required: the dataset prefix to write (PREFIX.bin and PREFIX.idx)")
    if args.workers < 1:
        return fail(f"--workers={args.workers} must be >= 1")
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
                                progress=not args.no_progress and sys.stderr.isatty(), workers=args.workers,
                                output_format=args.format)
    except (OSError, ValueError) as e:
        return fail(str(e))
    per_s = summary.input_bytes / max(summary.seconds, 1e-9) / 1e6
    print(f"wrote {summary.prefix}.bin/.idx: {summary.files} files, {summary.documents} documents, "
          f"{summary.tokens} tokens (vocab {tokenizer.vocab_size}, tokenizer {tokenizer.spec}, format {args.format}), "
          f"{summary.seconds:.2f} s ({per_s:.1f} MB/s)")
    if summary.skipped_empty:
        print(f"skipped {summary.skipped_empty} empty documents")
    return 0


def _inspect(args: argparse.Namespace, fail) -> int:
    from moe_fold.data.inspect import inspect_dataset

    if len(args.inputs) != 2:
        return fail("usage: moe-fold data inspect PATH (one dataset)")
    try:
        print(inspect_dataset(args.inputs[1], tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                              eod_id=args.eod_id, dtype=args.dtype, docs=args.docs, full=args.full))
    except (OSError, ValueError) as e:
        return fail(str(e))
    return 0
