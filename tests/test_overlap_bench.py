"""bench/overlap.py runs, and its fields mean what its docstring says.

Timings are not asserted: their relations are (the blocking variant leaves all of its
communication exposed; the planner's fraction follows its formula), and so is the timer
that every kind uses, on real gloo ranks.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from moe_fold import comm
from moe_fold.launch import run_ranks

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "overlap.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_overlap", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed_rank(rank, world_size):
    bench = _load_bench()
    ep = dist.new_group(list(range(world_size)), group_desc="ep")
    original = dist.all_to_all_single
    x = torch.ones(4, 2)
    with bench.blocked_seconds() as blocked:
        comm.all_to_all(x, None, None, ep)  # blocking: counted in full
        blocking = blocked["ep"]
        pending = comm.all_to_all_start(x, None, None, ep)
        launched = blocked["ep"]
        time.sleep(0.2)  # the transfer ends meanwhile: the wait finds it done
        pending.wait()
    restored = dist.all_to_all_single is original
    return {"blocking": blocking, "launch": launched - blocking, "wait": blocked["ep"] - launched,
            "kinds": sorted(blocked), "restored": restored}


def test_blocked_seconds_times_calls_and_waits_per_kind():
    for res in run_ranks(_timed_rank, 2, timeout=60):
        assert res["kinds"] == ["ep"] and res["restored"]
        assert res["blocking"] > 0 and res["launch"] >= 0
        assert res["wait"] < 0.2  # the sleep was not spent waiting


@pytest.mark.parametrize("dispatcher", ["alltoall", pytest.param("allgather", marks=pytest.mark.slow)])
def test_ep_kind_lines(dispatcher):
    # As a user runs it: a script whose ranks the launcher spawns from __main__.
    run = subprocess.run(
        [sys.executable, BENCH, "--kind", "ep", "--ep", "2", "--dispatcher", dispatcher, "--tokens", "32",
         "--hidden", "16", "--ffn", "16", "--shared-ffn", "32", "--rounds", "1", "--warmup", "0", "--timeout", "120"],
        capture_output=True, text=True, timeout=240, check=True)
    lines = {line["variant"]: line for line in map(json.loads, run.stdout.splitlines())}
    assert list(lines) == ["off", "shared", "chunks2", "shared+chunks2"]
    off = lines["off"]
    assert off["exposed_ms"] == off["comm_ms"] > 0 and off["exposed_fraction"] == 1.0
    assert off["ratio_to_off"] == 1.0 and off["planner_exposed_fraction"] == 1.0
    for line in lines.values():
        assert line["kind"] == "ep" and line["dispatcher"] == dispatcher
        assert line["comm_ms"] == off["comm_ms"] and line["step_ms_off"] == off["step_ms"]
        assert line["exposed_fraction"] == pytest.approx(line["exposed_ms"] / line["comm_ms"])
        assert line["step_ms"] > 0
        # The all-to-all dispatcher's count exchange runs over etp_ep, another kind than its
        # all-to-all's; the all-gather dispatcher's token counts travel over etp_ep, its own.
        assert line["other_blocked_ms"] > 0 if dispatcher == "alltoall" else line["other_blocked_ms"] == 0
        assert 0 <= line["planner_exposed_fraction"] <= 1
    # The planner: chunks leave at least the first dispatch and the last combine exposed
    # without the shared expert; with it, no more than either switch alone.
    assert lines["chunks2"]["planner_exposed_fraction"] >= 0.5
    assert lines["shared+chunks2"]["planner_exposed_fraction"] <= min(
        lines["shared"]["planner_exposed_fraction"], lines["chunks2"]["planner_exposed_fraction"])
