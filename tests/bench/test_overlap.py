"""bench/overlap.py's ep_alltoall kind: the MoE layer's overlap (moe.overlap_chunks,
moe.shared_expert_overlap) against the blocking dispatcher, and its all-to-all timer.

Timings are not asserted; what they are made of is: the timer counts blocking calls and
the waits on asynchronous ones, and the kind's record carries the fields its docstring
names, the planner's fraction from the same switches.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from moe_fold import comm
from moe_fold.config import load_config
from moe_fold.launch import run_ranks

from tests.helpers.paths import REPO

BENCH = str(REPO / "bench" / "overlap.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_overlap", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _timed_rank(rank, world_size):
    bench = _load_bench()
    ep = dist.new_group(list(range(world_size)), group_desc="ep")
    original = dist.all_to_all_single
    dist.all_to_all_single = bench._timed_all_to_all(original)
    try:
        x = torch.ones(4, 2)
        comm.all_to_all(x, None, None, ep)  # blocking: counted in full
        blocking = bench._ALL_TO_ALL_S[0]
        pending = comm.all_to_all_start(x, None, None, ep)
        posted = bench._ALL_TO_ALL_S[0]
        time.sleep(0.2)  # the transfer ends meanwhile: the wait finds it done
        pending.wait()
        waited = bench._ALL_TO_ALL_S[0]
    finally:
        dist.all_to_all_single = original
    return {"blocking": blocking, "post": posted - blocking, "wait": waited - posted}


def test_timer_counts_blocking_calls_and_waits():
    for res in run_ranks(_timed_rank, 2, timeout=60):
        assert res["blocking"] > 0 and res["post"] >= 0
        assert res["wait"] < 0.2  # the sleep was not spent waiting


def test_moe_overlap_settings_follow_the_preset():
    settings = _load_bench().KINDS["ep_alltoall"].settings
    assert settings(load_config("mixtral-tiny")) == {"off": [], "chunks2": ["moe.overlap_chunks=2"]}
    assert settings(load_config("qwen2-moe-tiny")) == {
        "off": [], "chunks2": ["moe.overlap_chunks=2"], "shared": ["moe.shared_expert_overlap=true"],
        "shared+chunks2": ["moe.shared_expert_overlap=true", "moe.overlap_chunks=2"]}


def test_ep_alltoall_record():
    # As a user runs it: a script whose ranks the launcher spawns from __main__.
    run = subprocess.run(
        [sys.executable, BENCH, "--world", "2", "--preset", "qwen2-moe-tiny", "--kinds", "ep_alltoall",
         "--rounds", "1", "--set", "parallel.ep=2", "--set", "model.num_layers=2", "--set", "model.seq_length=32",
         "--set", "train.global_batch_size=4"],
        capture_output=True, text=True, timeout=300, check=True)
    records = {r["setting"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert list(records) == ["chunks2", "shared", "shared+chunks2"]
    for record in records.values():
        assert record["kind"] == "ep_alltoall" and record["bytes_per_step"] > 0
        assert record["comm_ms"] > 0 and record["exposed_ms_on"] >= 0 and record["step_ms_on"] > 0
        assert abs(record["exposed_fraction"] - record["exposed_ms_on"] / record["comm_ms"]) < 1e-9
        # The planner hides part of the all-to-all with a switch on, never more than all.
        assert 0 <= record["planner_exposed_fraction"] < 1 and record["planner_comm_ms"] > 0
    # Two chunks leave at least the first dispatch and the last combine: half (planner/moe_overlap.py).
    assert records["chunks2"]["planner_exposed_fraction"] >= 0.5 - 1e-9
    assert records["shared+chunks2"]["planner_exposed_fraction"] <= records["chunks2"]["planner_exposed_fraction"]
