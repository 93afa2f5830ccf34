"""The benchmark suite: every script in bench/ at a small size, one after the other.

Each case runs ``python -m bench.<bench> <flags>`` in its own process, as a user would run
it alone: thread settings and the environment the scripts set before torch starts
(``OMP_WAIT_POLICY``, ``THP_MEM_ALLOC_ENABLE``) stay per benchmark, and a benchmark that
crashes or hangs costs its own case only (an ``error`` record), not the suite. A benchmark
prints JSON lines on stdout; every line becomes one record, with ``suite_case`` and
``suite_flags`` added. The results file starts with a ``{"bench": "suite", "event":
"start"}`` record (date, commit, load average, versions) and ends with an ``"end"`` one
(seconds and outcome per case).

Sizes: ``full`` finishes in a few minutes on a loaded 2-core CPU machine (17 cases; the 13
before bench/placement.py and bench/checkpoint.py joined took about 210 s at load average 7-19;
the checkpoint stall at 107M parameters writes about 10 GB: 2-3 minutes more), ``quick`` runs
cases at smaller shapes (170 s there for the 9 before them: each
case's start, importing torch and spawning ranks, takes 5-20 s of it), ``smoke`` only checks
the plumbing (tiny shapes, one round). The dispatch
cases sweep the EP size at a fixed number of tokens per rank and, at the largest EP, the
routing skew; the GEMM cases sweep tokens per expert: the plots are drawn from those.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The sizes a run can take: smoke checks the plumbing in seconds per benchmark.
SIZES = ("smoke", "quick", "full")
BENCHES = ("dispatch", "gemm", "permute", "moe_layer", "pipeline_bubble", "attention", "cp_attention", "dynamic_cp",
           "placement", "overlap", "train", "checkpoint")


@dataclass(frozen=True)
class Case:
    """One invocation of ``python -m bench.<bench>`` with ``flags``; ``name`` is unique within the bench."""

    bench: str
    name: str
    flags: tuple[str, ...]


class BenchError(RuntimeError):
    """A case that exited with an error, timed out, or printed something other than records."""


def _dispatch_cases(size: str) -> list[Case]:
    if size == "smoke":
        return [Case("dispatch", "ep2", ("--tokens", "64", "--hidden", "32", "--experts", "4", "--topk", "2",
                                         "--ep", "2", "--routing", "balanced,zipf", "--iters", "1",
                                         "--warmup", "0"))]
    tokens, hidden, iters = ("256", "128", "3") if size == "quick" else ("1024", "256", "5")
    shape = ("--tokens", tokens, "--hidden", hidden, "--experts", "8", "--topk", "2", "--iters", iters)
    eps = (2, 4) if size == "quick" else (1, 2, 4)
    cases = [Case("dispatch", f"ep{ep}", shape + ("--ep", str(ep), "--dispatcher", "alltoall,allgather",
                                                  "--routing", "balanced,random,zipf" if ep == eps[-1] else "balanced"))
             for ep in eps]
    if size == "full":  # one more skew level for the skew plot
        cases.append(Case("dispatch", f"ep{eps[-1]}-zipf2.5",
                          shape + ("--ep", str(eps[-1]), "--routing", "zipf", "--zipf-s", "2.5")))
    return cases


def _gemm_cases(size: str) -> list[Case]:
    if size == "smoke":
        return [Case("gemm", "t32", ("--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "4",
                                     "--topk", "2", "--repeats", "1", "--routing", "balanced"))]
    tokens, repeats = (("64", "1024"), "5") if size == "quick" else (("64", "256", "2048"), "5")
    # 8 experts, top-2: tokens per expert = tokens / 4.
    return [Case("gemm", f"t{t}", ("--tokens", t, "--hidden", "256", "--ffn", "256", "--experts", "8",
                                   "--topk", "2", "--repeats", repeats, "--routing", "balanced,skewed"))
            for t in tokens]


def _permute_cases(size: str) -> list[Case]:
    tokens, hidden, experts, topk, repeats = {
        "smoke": ("64", "32", "4", "2", "1"),
        "quick": ("1024", "256", "8", "2", "5"),
        "full": ("4096", "512", "16", "4", "7"),
    }[size]
    return [Case("permute", f"t{tokens}", ("--tokens", tokens, "--hidden", hidden, "--experts", experts,
                                           "--topk", topk, "--repeats", repeats))]


def _moe_layer_cases(size: str) -> list[Case]:
    shape, rounds, hf_gib, ep = {
        "smoke": ("64x32x64x4x2", "1", "0.01", "1"),
        "quick": ("512x128x256x8x2", "3", "0.05", "1,2"),
        "full": ("2048x256x512x8x2", "5", "0.25", "1,2,4"),
    }[size]
    # --hf-memory-gib keeps transformers' batched_mm (one gathered weight per token and
    # expert) to a few seconds: it is timed on fewer tokens, on its own record.
    return [Case("moe_layer", shape, ("--shapes", shape, "--rounds", rounds, "--iters", "1",
                                      "--hf-memory-gib", hf_gib, "--ep", ep))]


def _pipeline_cases(size: str) -> list[Case]:
    pp, microbatches, forward_ms, repeats = {
        "smoke": ("2", "2", "2", "1"),
        "quick": ("2", "4,8", "5", "1"),
        "full": ("2,4", "4,8", "10", "2"),
    }[size]
    return [Case("pipeline_bubble", f"pp{pp}", ("--pp", pp, "--microbatches", microbatches,
                                                "--forward-ms", forward_ms, "--repeats", repeats))]


def _attention_cases(size: str) -> list[Case]:
    # Few long documents, then many short ones: where the per-document loop pays the most.
    seq, docs, repeats = {
        "smoke": ("64", ("32", "8"), "1"),
        "quick": ("1024", ("512", "32"), "3"),
        "full": ("4096", ("2048", "64"), "5"),
    }[size]
    return [Case("attention", f"seq{seq}-docs{d}", ("--seq", seq, "--docs", d, "--repeats", repeats)) for d in docs]


def _cp_cases(size: str) -> list[Case]:
    seq, heads, kv_heads, head_dim, cps, repeats = {
        "smoke": ("64", "2", "1", "16", "2", "1"),
        "quick": ("512", "4", "2", "32", "2", "3"),
        "full": ("1024", "8", "4", "32", "2,4", "3"),
    }[size]
    return [Case("cp_attention", f"seq{seq}", ("--seq", seq, "--heads", heads, "--kv-heads", kv_heads,
                                               "--head-dim", head_dim, "--cps", cps, "--repeats", repeats))]


def _dynamic_cp_cases(size: str) -> list[Case]:
    cp, seq, micro_batches, repeats = {
        "smoke": ("2", "128", "1", "1"),
        "quick": ("2", "512", "2", "2"),
        "full": ("4", "1024", "4", "3"),
    }[size]
    return [Case("dynamic_cp", f"cp{cp}-seq{seq}", ("--cp", cp, "--seq", seq, "--micro-batches", micro_batches,
                                                    "--repeats", repeats))]


def _placement_cases(size: str) -> list[Case]:
    tokens, hidden, ffn, steps, every = {
        "smoke": ("128", "32", "64", "4", "2"),
        "quick": ("512", "128", "256", "12", "4"),
        "full": ("2048", "256", "512", "24", "4"),
    }[size]
    # The shape: 16 experts on ep4, zipf s=1.2, top-2.
    return [Case("placement", f"ep4-e16-t{tokens}", ("--tokens", tokens, "--hidden", hidden, "--ffn", ffn,
                                                     "--experts", "16", "--topk", "2", "--ep", "4",
                                                     "--steps", steps, "--replace-every", every,
                                                     "--routing", "zipf,drift"))]


def _overlap_cases(size: str) -> list[Case]:
    world, sets, rounds = {
        "smoke": ("2", ("model.num_layers=1", "model.seq_length=32"), "1"),
        "quick": ("4", ("model.seq_length=64",), "3"),
        "full": ("4", (), "5"),
    }[size]
    return [Case("overlap", f"mixtral-tiny-w{world}", ("--world", world, "--preset", "mixtral-tiny",
                                                       *(f for s in sets for f in ("--set", s)),
                                                       "--bucket-numel", "65536", "--rounds", rounds))]


def _train_cases(size: str) -> list[Case]:
    micro_batch, seq, rounds, mm, impls = {
        "smoke": ("1", "32", "1", "256", "eager"),
        "quick": ("2", "128", "2", "512", "eager,grouped_mm"),
        "full": ("4", "128", "3", "1024", "eager,grouped_mm"),
    }[size]
    # transformers' batched_mm gathers a weight matrix per token and expert: seconds per
    # step here, never the fastest; bench/moe_layer.py times it on a single layer.
    return [Case("train", f"mixtral-tiny-mb{micro_batch}", (
        "--preset", "mixtral-tiny", "--set", f"model.seq_length={seq}", "--micro-batch", micro_batch,
        "--rounds", rounds, "--iters", "1", "--warmup", "1", "--threads", "2", "--mm", mm, "--impls", impls))]


def _checkpoint_cases(size: str) -> list[Case]:
    # full: mixtral-tiny scaled to 107M parameters (the script's default), 1.3 GB a save.
    scale, rounds, steps = {
        "smoke": (("--set", "model.hidden_size=64", "--set", "parallel.ep=1"), "1", "1"),
        "quick": (("--set", "model.hidden_size=256", "--set", "model.num_layers=4", "--set", "parallel.ep=1"), "2", "2"),
        "full": ((), "3", "1"),
    }[size]
    return [Case("checkpoint", "stall", (*scale, "--rounds", rounds, "--train-steps", steps, "--threads", "2"))]


def cases(size: str) -> list[Case]:
    """Every case of the suite at ``size`` (``smoke``, ``quick`` or ``full``), in run order."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
    return [*_dispatch_cases(size), *_gemm_cases(size), *_permute_cases(size), *_moe_layer_cases(size),
            *_pipeline_cases(size), *_attention_cases(size), *_cp_cases(size), *_dynamic_cp_cases(size),
            *_placement_cases(size), *_overlap_cases(size), *_train_cases(size), *_checkpoint_cases(size)]


def select(all_cases: list[Case], only: str | None) -> list[Case]:
    """The cases of the benchmarks named in ``only`` (a comma list), or all of them."""
    if not only:
        return list(all_cases)
    names = [n for n in only.split(",") if n]
    bad = [n for n in names if n not in BENCHES]
    if bad or not names:
        raise ValueError(f"--only {only!r}: {', '.join(bad) or 'no name'} is not a benchmark; "
                         f"choose from {', '.join(BENCHES)}")
    return [c for c in all_cases if c.bench in names]


def run_case(case: Case, bench_dir: Path, env: dict, timeout: float) -> list[dict]:
    """The records ``bench/<bench>.py`` prints; a :class:`BenchError` saying why if it fails."""
    script = bench_dir / f"{case.bench}.py"
    if not script.is_file():
        raise BenchError(f"{script} does not exist")
    # Its own session, so that stopping it also stops the rank processes it spawned.
    with subprocess.Popen([sys.executable, "-m", f"bench.{case.bench}", *case.flags], cwd=bench_dir.parent, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as err:  # the timeout, or Ctrl-C (which the new session does not get)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if isinstance(err, subprocess.TimeoutExpired):
                raise BenchError(f"still running after --timeout {timeout:g} s; stopped") from None
            raise
    if proc.returncode:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise BenchError(f"exit code {proc.returncode}: {tail}")
    records = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"printed a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(record, dict) or "bench" not in record:
            raise BenchError(f"printed JSON that is not a record with a 'bench' field: {line[:200]!r}")
        records.append(record)
    if not records:
        raise BenchError("printed no records")
    return records


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def start_record(root: Path, size: str, selected: list[Case], now: datetime.datetime) -> dict:
    import torch

    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {
        "bench": "suite", "event": "start", "date": now.isoformat(timespec="seconds"), "size": size,
        "benches": sorted({c.bench for c in selected}, key=BENCHES.index), "cases": len(selected),
        "commit": commit, "local_changes": bool(status) if status is not None else None,
        "load_avg": _load(), "cpus": os.cpu_count(), "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    }


def run(args: argparse.Namespace, root: Path) -> int:
    """Run the suite as ``args`` (see :func:`bench.__main__.add_arguments`) ask; 0 when
    every case produced records, 1 when one failed, 2 for bad arguments."""
    from rich.console import Console

    from bench import plots, table

    # Not a terminal (a log, a pipe): wide enough for the table not to fold every cell.
    # Messages carry paths and benchmarks' errors: plain text, no markup or colouring.
    console = Console(width=None if sys.stdout.isatty() else 180, markup=False, highlight=False)
    try:
        selected = select(cases(args.size), args.only)
    except ValueError as err:
        console.print(f"error: {err}")
        return 2
    if args.list:
        for case in selected:
            command = f"python -m bench.{case.bench} {' '.join(case.flags)}"
            console.print(f"{case.bench:16} {case.name:16} {command}", soft_wrap=True)
        return 0

    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else root / "bench" / "results" / f"{now:%Y-%m-%dT%H-%M-%SZ}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Spinning OpenMP waits measure the machine's load, not the code (bench/gemm.py says
    # how much); the scripts that use several threads set this too, a value given wins.
    # Triton's interpreter (TRITON_INTERPRET=1, set by the tests) runs kernels in Python:
    # timing it measures nothing, so the benchmarks see only the backends that compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    start = start_record(root, args.size, selected, now)
    load = " ".join(f"{x:g}" for x in start["load_avg"])
    console.print(f"moe-fold bench, size {args.size}: {len(selected)} cases, {now:%Y-%m-%d %H:%M:%S} UTC, "
                  f"commit {(start['commit'] or 'unknown')[:10]}{' + local changes' if start['local_changes'] else ''}, "
                  f"{start['cpus']} CPUs, load average {load} (1/5/15 min), torch {start['torch']}")

    records, outcomes, t_suite = [], [], time.perf_counter()
    with out.open("w") as f:
        f.write(json.dumps(start) + "\n")
        for i, case in enumerate(selected, 1):
            console.print(f"[{i}/{len(selected)}] {case.bench} {case.name} ...", end=" ")
            t0 = time.perf_counter()
            try:
                got = run_case(case, root / "bench", env, args.timeout)
                error = None
            except BenchError as err:
                got, error = [{"bench": case.bench, "error": str(err)}], str(err)
            seconds = round(time.perf_counter() - t0, 1)
            console.print(f"{seconds} s" + (f", error: {error}" if error else f", {len(got)} records"))
            for record in got:
                record.update(suite_case=case.name, suite_flags=list(case.flags))
                f.write(json.dumps(record) + "\n")
                f.flush()
            records += got
            outcomes.append({"bench": case.bench, "case": case.name, "seconds": seconds, "records": len(got),
                             "error": error})
        total = round(time.perf_counter() - t_suite, 1)
        f.write(json.dumps({"bench": "suite", "event": "end", "seconds": total, "load_avg": _load(),
                            "cases": outcomes}) + "\n")

    console.print(table.render(records))
    failed = [o for o in outcomes if o["error"]]
    console.print(f"{len(records)} records in {out} ({total} s; load average now "
                  f"{' '.join(f'{x:g}' for x in _load())}){f', {len(failed)} cases failed' if failed else ''}")
    if not args.no_plots:
        try:
            written, missing = plots.write_plots(records, out.with_suffix(""))
        except ImportError as err:
            console.print(f"no plots: {err}")
        else:
            for path in written:
                console.print(f"plot: {path}")
            for name, why in missing.items():
                console.print(f"no {name} plot: {why}")
    return 1 if failed else 0
