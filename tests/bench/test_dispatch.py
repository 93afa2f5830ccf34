"""bench/dispatch.py runs and its byte fields mean what its docstring says.

Timings are not asserted; bytes are, against counts worked out here from the same
routing the benchmark builds (``make_routing`` with each rank's seed).
"""

import importlib.util
import json
import os
import subprocess
import sys

import torch

from tests.helpers.paths import REPO

H, T, E, K, EP = 16, 12, 4, 2, 2


BENCH = str(REPO / "bench" / "dispatch.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_dispatch", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_bytes_match_the_routing():
    bench = _load_bench()
    # As a user runs it: a script whose ranks the launcher spawns from __main__.
    run = subprocess.run(
        [sys.executable, BENCH, "--tokens", str(T), "--hidden", str(H), "--experts", str(E), "--topk", str(K),
         "--ep", str(EP), "--dispatcher", "alltoall,allgather", "--mode", "dropless,dedup",
         "--routing", "zipf", "--iters", "1", "--warmup", "0", "--timeout", "120"],
        capture_output=True, text=True, timeout=240, check=True)
    assert "skipping allgather with mode dedup" in run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    by_kind = {(line["dispatcher"], line["mode"]): line for line in lines}
    assert set(by_kind) == {("alltoall", "dropless"), ("alltoall", "dedup"), ("allgather", "dropless")}
    row = H * 4
    pairs = distinct = 0
    for rank in range(EP):
        _, routing_map = bench.make_routing("zipf", T, E, K, seed=rank, zipf_s=1.2)
        owner = torch.arange(E) // (E // EP)
        remote = routing_map & (owner != rank)
        pairs += int(remote.sum())
        distinct += sum(len(set(owner[remote[t]].tolist())) for t in range(T))
    # Per rank, mean over ranks; each remote pair goes out in dispatch and back in combine.
    assert by_kind[("alltoall", "dropless")]["bytes_tokens"] == 2 * pairs * row // EP
    assert by_kind[("alltoall", "dedup")]["bytes_tokens"] == 2 * distinct * row // EP
    assert by_kind[("alltoall", "dedup")]["bytes_min"] == 2 * distinct * row // EP
    assert by_kind[("allgather", "dropless")]["bytes_tokens"] == 2 * T * (EP - 1) * row
    for line in lines:
        assert line["bytes_sent"] > line["bytes_tokens"]  # probs and counts travel too
        assert line["ms"] > 0 and line["tokens_per_s"] > 0
