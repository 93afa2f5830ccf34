"""Data benchmark: how fast text becomes tokens, and whether loading could ever slow training.

    python -m bench.data [--mb 8] [--bpe-vocab 4096] [--workers 1,2] [--rounds 3]
                         [--loader-batches 200] [--train-steps 6] [--no-train]

Corpus: the demo corpus (the standard library's ``.py`` files, on every machine) written
as one JSONL file of ``--mb`` MB, one record per file. Candidates, interleaved round after
round (medians over ``--rounds``; on a shared machine the rounds spread):

- ``tokenize``: ``moe-fold data`` (:func:`moe_fold.data.preprocess.build_dataset`) with the
  byte tokenizer and a byte-level BPE of ``--bpe-vocab`` trained on the corpus, at each
  ``--workers`` count: input MB/s, wall time from start to renamed files (worker start-up
  included). ``speedup`` = MB/s at N workers / MB/s at 1, same tokenizer, same round set.
  The tokenizers library's own threads are pinned to ``--tokenizer-threads`` (1) in the
  one-process case; N workers take cores/N each. Worker start-up (a fresh interpreter
  each, ~0.5 s) is a fixed cost: use a larger ``--mb`` to see the steady rate.
  Each record also has the CPU seconds of the main process and of the workers, and
  ``critical_path_cpu_s`` = max(main, workers / N): the wall time on N idle cores.
  ``critical_path_speedup`` compares those, for a machine whose load hides the wall-clock
  speed-up (under Linux's autogroup scheduling a session's processes share one CPU share,
  so on a saturated machine N workers get no more CPU than one).
- ``megatron_method``: what Megatron-LM's ``tools/preprocess_data.py`` does per worker, as
  its source documents it, rebuilt here with the same tokenizer: the main process reads
  lines, ``multiprocessing.Pool(workers).imap(encode, lines, 32)`` sends each line to a
  worker that parses the JSON and tokenizes that one document (no batch encoding), and the
  main process appends each document to the Megatron builder. ``ratio_ours_to_megatron``
  = our MB/s / its MB/s at the same workers and tokenizer; both write Megatron's format
  here, and ``same_bytes`` says the two outputs are identical.
- ``loader``: :class:`moe_fold.data.loader.DataLoader` over the byte dataset at
  mixtral-tiny's sample length and batch (fixed-length and packed): tokens/s per rank
  (one dp rank reads ``micro_batch_size * seq_length`` tokens a micro-batch).
- ``train``: ``--train-steps`` steps of mixtral-tiny on one process (ep=1): its
  ``tokens_per_s`` (median over the steps after the first). ``loader_over_train`` = loader
  tokens/s / training tokens/s: how many times faster the loader feeds than one rank eats.

Output: one JSON line per measurement, then a summary line (``"case": "summary"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path



def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=8.0, help="corpus size in MB (default 8)")
    p.add_argument("--bpe-vocab", type=int, default=4096, help="vocabulary of the trained BPE (default 4096)")
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--loader-batches", type=int, default=200, help="micro-batches the loader reads (default 200)")
    p.add_argument("--train-steps", type=int, default=6, help="mixtral-tiny steps to time (default 6)")
    p.add_argument("--no-train", action="store_true", help="skip the training step (loader numbers only)")
    p.add_argument("--tokenizer-threads", type=int, default=1,
                   help="threads of the tokenizers library in the --workers 1 process (default 1: one core, so "
                        "the speed-up is that of processes; workers get cores/N each)")
    return p.parse_args()


def write_corpus(folder: Path, mb: float) -> Path:
    from moe_fold.data.corpus import demo_corpus_files

    out = folder / "corpus.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for path in demo_corpus_files(int(mb * 1e6)):
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return out


# --------------------------------------------------------------------------- Megatron's method

_TOKENIZER = None


def _megatron_init(spec: str) -> None:
    global _TOKENIZER
    from moe_fold.data.tokenizer import load_tokenizer

    _TOKENIZER = load_tokenizer(spec)


def _megatron_encode(line: str):
    # One JSON line in, one document's ids out (+ eod, as --append-eod), like its Encoder.encode.
    ids = _TOKENIZER.encode(json.loads(line)["text"])
    if ids:
        ids.append(_TOKENIZER.eod_id)
    return ids, len(line)


def megatron_method(corpus: Path, spec: str, workers: int, prefix: Path) -> float:
    """Seconds to write ``prefix`` the way preprocess_data.py does (see the docstring)."""
    import multiprocessing

    from moe_fold.data.megatron_dataset import MegatronDatasetWriter
    from moe_fold.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    tok = load_tokenizer(spec)
    with open(corpus, encoding="utf-8") as fin, \
            multiprocessing.get_context("spawn").Pool(workers, initializer=_megatron_init, initargs=(spec,)) as pool, \
            MegatronDatasetWriter(prefix, tok.vocab_size, tok.eod_id) as writer:
        for ids, _ in pool.imap(_megatron_encode, fin, 32):
            if ids:
                writer.add_document(ids)
    return time.perf_counter() - start


def ours(corpus: Path, spec: str, workers: int, prefix: Path, fmt: str) -> float:
    from moe_fold.data.preprocess import build_dataset
    from moe_fold.data.tokenizer import load_tokenizer

    start = time.perf_counter()
    build_dataset([corpus], load_tokenizer(spec), prefix, workers=workers, output_format=fmt)
    return time.perf_counter() - start


def timed(run) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, CPU seconds of the worker processes it
    started and reaped during ``run``)."""
    import resource

    def children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    cpu0, kids0 = time.process_time(), children()
    wall = run()
    return wall, time.process_time() - cpu0, children() - kids0


def same_files(a: Path, b: Path) -> bool:
    return all(Path(f"{a}.{e}").read_bytes() == Path(f"{b}.{e}").read_bytes() for e in ("bin", "idx"))


# --------------------------------------------------------------------------- loader and training

def loader_tokens_per_s(prefix: Path, batches: int, packing: bool) -> tuple[float, int, int]:
    from moe_fold.config import load_config
    from moe_fold.data.loader import DataLoader, open_training_dataset

    c = load_config("mixtral-tiny", ["parallel.ep=1"])
    ds = open_training_dataset([prefix], None, c.model.seq_length, 0, packing=packing,
                               max_vocab_size=c.model.vocab_size)
    loader = DataLoader(ds, c.train.global_batch_size, c.train.micro_batch_size)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    tokens = batches * c.train.micro_batch_size * c.model.seq_length
    return tokens / seconds, c.model.seq_length, c.train.micro_batch_size


def train_tokens_per_s(prefix: Path, steps: int, run_dir: Path) -> float:
    from moe_fold.config import load_config
    from moe_fold.training.train import read_metrics, train

    config = load_config("mixtral-tiny", ["parallel.ep=1", "wandb.mode=disabled", f"train.steps={steps}",
                                          "train.save_every=100000", "optimizer.warmup_steps=1",
                                          f"train.run_dir={run_dir}", f"data.path={prefix}"])
    train(config, progress=False)
    return statistics.median(r["tokens_per_s"] for r in read_metrics(run_dir)[1:])


def main() -> None:
    args = parse_args()
    # Read by the tokenizers library when it first encodes in this process.
    os.environ["RAYON_NUM_THREADS"] = str(args.tokenizer_threads)
    workers = [int(w) for w in args.workers.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    emit = lambda record: print(json.dumps({"bench": "data", **record}), flush=True)  # noqa: E731
    try:
        from moe_fold.data.tokenizer import train_bpe

        corpus = write_corpus(tmp, args.mb)
        mb = corpus.stat().st_size / 1e6
        bpe = tmp / "bpe.json"
        train_bpe([corpus], args.bpe_vocab, bpe)
        specs = {"byte": "byte", "bpe": str(bpe)}
        times: dict[tuple, list[float]] = {}
        for r in range(args.rounds):
            for name, spec in specs.items():
                for w in workers:
                    for case, run in (("tokenize", lambda: ours(corpus, spec, w, tmp / "o", "megatron")),
                                      ("megatron_method", lambda: megatron_method(corpus, spec, w, tmp / "m"))):
                        s, cpu_main, cpu_workers = timed(run)
                        # With the workers' CPU time spread evenly, the slowest process's CPU time
                        # is the wall time on idle cores: the speed-up a loaded machine hides.
                        critical = max(cpu_main, cpu_workers / w)
                        times.setdefault((case, name, w), []).append(s)
                        times.setdefault(("critical", case, name, w), []).append(critical)
                        emit({"case": case, "tokenizer": name, "workers": w, "round": r, "mb": round(mb, 2),
                              "seconds": round(s, 3), "mb_per_s": round(mb / s, 2),
                              "cpu_s_main": round(cpu_main, 3), "cpu_s_workers": round(cpu_workers, 3),
                              "critical_path_cpu_s": round(critical, 3)})
                    if r == 0:
                        times.setdefault(("same_bytes", name, w), []).append(float(same_files(tmp / "o", tmp / "m")))
        summary: dict = {"case": "summary", "mb": round(mb, 2), "rounds": args.rounds,
                         "load_average": round(os.getloadavg()[0], 1)}
        for name in specs:
            for w in workers:
                ours_mbs = mb / statistics.median(times[("tokenize", name, w)])
                meg_mbs = mb / statistics.median(times[("megatron_method", name, w)])
                summary[f"{name}_w{w}_mb_per_s"] = round(ours_mbs, 2)
                summary[f"{name}_w{w}_megatron_method_mb_per_s"] = round(meg_mbs, 2)
                summary[f"{name}_w{w}_ratio_ours_to_megatron"] = round(ours_mbs / meg_mbs, 3)
                summary[f"{name}_w{w}_same_bytes"] = bool(times[("same_bytes", name, w)][0])
            base = statistics.median(times[("tokenize", name, workers[0])])
            base_cpu = statistics.median(times[("critical", "tokenize", name, workers[0])])
            for w in workers[1:]:
                summary[f"{name}_speedup_w{w}_vs_w{workers[0]}"] = round(
                    base / statistics.median(times[("tokenize", name, w)]), 3)
                summary[f"{name}_critical_path_speedup_w{w}_vs_w{workers[0]}"] = round(
                    base_cpu / statistics.median(times[("critical", "tokenize", name, w)]), 3)

        byte_prefix = tmp / "byte"
        ours(corpus, "byte", 1, byte_prefix, "moefidx")
        for packing in (False, True):
            tps, seq, mbs = loader_tokens_per_s(byte_prefix, args.loader_batches, packing)
            emit({"case": "loader", "packing": packing, "seq_length": seq, "micro_batch_size": mbs,
                  "tokens_per_s_per_rank": round(tps)})
            summary[f"loader{'_packed' if packing else ''}_tokens_per_s_per_rank"] = round(tps)
        if not args.no_train:
            import torch

            torch.set_num_threads(1)
            train_tps = train_tokens_per_s(byte_prefix, args.train_steps, tmp / "run")
            emit({"case": "train", "preset": "mixtral-tiny", "threads": 1, "tokens_per_s": round(train_tps)})
            summary["train_tokens_per_s"] = round(train_tps)
            summary["loader_over_train"] = round(summary["loader_tokens_per_s_per_rank"] / train_tps, 1)
            summary["loader_packed_over_train"] = round(summary["loader_packed_tokens_per_s_per_rank"] / train_tps, 1)
        emit(summary)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
