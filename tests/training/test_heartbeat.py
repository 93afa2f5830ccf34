"""Hang detection (moe_fold.training.heartbeat, issue 28 part 2).

- A rank of `moe-fold train --nproc 2 --max-restarts 1` stopped with SIGSTOP is named
  (with its last step) within train.hang_timeout_s plus a few seconds, far below
  parallel.timeout_s; the live rank writes its Python stacks to the run folder; the group
  exits, the launcher restarts it from the newest checkpoint, and the run finishes with
  the uninterrupted run's losses bit for bit.
- Legitimately long phases (the first step, a checkpoint save, an evaluation, a
  re-placement) do not fire it; the same delay in an ordinary step does.
- The lowest live rank on a stopped rank's host kills it (SIGKILL), only that process.
- The diagnosis names a stopped rank (its watcher thread is silent) rather than the live
  ranks that wait for it, and, when every rank is alive, the least advanced one.
- Budgets: what the module docstring promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_fold.training import heartbeat as hb
from moe_fold.training.heartbeat import HANG_EXIT_CODE, Heartbeat
from moe_fold.training.train import read_metrics
from tests.training.test_reliability import (ROOT, _cli, _env, _losses, _rank_pids, _set, _wait_for, overrides, small_config)


# --------------------------------------------------------------------------- budgets

def test_budgets_first_phases_get_the_collective_timeout_then_measured_ones():
    beat = Heartbeat(None, 0, 1, Path("unused"), hang_timeout_s=None, first_budget_s=300.0)
    assert beat.budget("step") == beat.budget("save") == 300.0  # never measured: the collective timeout
    beat.durations = {"step": [0.5, 4.0, 1.0], "save": [0.1], "eval": [7.0]}
    assert beat.budget("step") == 40.0  # 10 x the longest
    assert beat.budget("save") == hb.FLOOR_S  # the floor
    assert beat.budget("eval") == 70.0
    assert beat.budget("replace") == 300.0
    explicit = Heartbeat(None, 0, 1, Path("unused"), hang_timeout_s=45.0, first_budget_s=300.0)
    assert explicit.budget("step") == 300.0  # the first step is still long
    explicit.durations = {"step": [0.5, 9.0], "save": [0.1], "eval": [7.0]}
    assert explicit.budget("step") == 45.0  # train.hang_timeout_s, as set
    assert explicit.budget("save") == 45.0  # at least train.hang_timeout_s
    assert explicit.budget("eval") == 70.0



def test_stop_grace_covers_the_longest_step_and_save_measured():
    """A torchrun worker whose agent is gone gets, to finish its step and save, the factor
    times its longest step plus its longest save: never less than the floor, and other
    phases (an eval) do not count."""
    beat = Heartbeat(None, 0, 1, Path("unused"), hang_timeout_s=None, first_budget_s=300.0)
    assert beat.stop_grace_s(5.0) == 5.0  # nothing measured yet: the floor
    beat.durations = {"step": [0.5, 4.0, 1.0], "save": [3.0, 0.5], "eval": [70.0]}
    assert beat.stop_grace_s(5.0) == hb.STOP_GRACE_FACTOR * (4.0 + 3.0)
    beat.durations = {"step": [0.2], "save": [0.1]}
    assert beat.stop_grace_s(5.0) == 5.0

def test_beats_measure_each_phase_until_the_next_beat(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(hb.time, "monotonic", lambda: now[0])
    store = dist.HashStore()
    beat = Heartbeat(None, 1, 2, Path("unused"), hang_timeout_s=None, first_budget_s=300.0)
    beat.store = store  # written to, but no watcher thread
    for step, phase, took in [(1, "step", 2.0), (1, "save", 0.5), (2, "step", 3.0), (3, "step", 1.0)]:
        beat.beat(step, phase)
        now[0] += took
    assert {k: list(v) for k, v in beat.durations.items()} == {"step": [2.0, 3.0], "save": [0.5]}
    assert json.loads(store.get("moe-fold/heartbeat/progress/1")) == {"seq": 4, "step": 3, "phase": "step",
                                                                       "budget_s": 30.0}


def test_step_beats_are_written_at_most_every_poll_and_the_watcher_writes_the_newest(monkeypatch):
    """Many short steps put one write a second on the store, not one per step; a change of
    phase is written at once; the watcher's tick writes the newest beat still held."""
    now = [100.0]
    monkeypatch.setattr(hb.time, "monotonic", lambda: now[0])
    writes = []

    class Store(dist.HashStore):
        def set(self, key, value):
            writes.append(json.loads(value)["seq"]) if "progress" in key else None
            super().set(key, value)

    store = Store()
    beat = Heartbeat(None, 1, 2, Path("unused"), hang_timeout_s=5.0, first_budget_s=300.0)
    beat.store = store  # written to, but no watcher thread
    for step in range(1, 21):  # 20 steps of 125 ms
        beat.beat(step, "step")
        now[0] += 0.125
    assert writes == [1, 9, 17]  # the first, then one every POLL_S
    beat._tick()  # the watcher thread, a tick later: the newest beat goes out
    assert writes == [1, 9, 17, 20] and json.loads(store.get("moe-fold/heartbeat/progress/1"))["step"] == 20
    beat._tick()
    assert writes == [1, 9, 17, 20]  # nothing new to write
    beat.beat(20, "save")  # a new phase: at once
    assert writes == [1, 9, 17, 20, 21]


def test_a_beat_never_fails_the_step_when_the_store_is_gone(capsys):
    """The torchrun agent (or the launcher) died and took its store along: the ranks are
    stopping with a checkpoint (tests/training/test_stop.py::test_workers_of_a_dead_torchrun_agent_stop_within_seconds),
    so a beat says once that the watch is off and lets the save go on."""
    class GoneStore:
        calls = 0

        def set(self, key, value):
            GoneStore.calls += 1
            raise RuntimeError("Connection reset by peer")

    beat = Heartbeat(None, 0, 2, Path("unused"), hang_timeout_s=None, first_budget_s=300.0)
    beat.store = GoneStore()  # no watcher thread
    beat.beat(4, "step")
    beat.beat(4, "save")
    assert GoneStore.calls == 1  # tried once, then off
    assert capsys.readouterr().err.count("hang watch off: the store is gone") == 1


def test_config_rules():
    from moe_fold.config import ConfigError, load_config, validate

    for value, rule in [("-1", "train.hang_timeout_s=-1.0 must be >= 0"),
                        ("300", r"train.hang_timeout_s=300.0 must be below parallel.timeout_s=300.0")]:
        with pytest.raises(ConfigError, match=rule):
            validate(load_config("mixtral-tiny", [f"train.hang_timeout_s={value}"]), 2)
    validate(load_config("mixtral-tiny", ["train.hang_timeout_s=0"]), 2)  # off


# --------------------------------------------------------------------------- the diagnosis

def _beats(store, world, seqs):
    for r in range(world):
        store.set(f"moe-fold/heartbeat/progress/{r}", json.dumps({"seq": seqs[r], "step": 7, "phase": "step",
                                                                   "budget_s": 5.0}))
        store.set(f"moe-fold/heartbeat/alive/{r}", "1")


def _diagnosis(monkeypatch, seqs, live):
    """Rank 0 diagnoses a 4-rank world where the ranks of ``live`` keep ticking."""
    monkeypatch.setattr(hb, "POLL_S", 0.01)
    store = dist.HashStore()
    _beats(store, 4, seqs)
    watcher = Heartbeat(None, 0, 4, Path("unused"), hang_timeout_s=5.0, first_budget_s=60.0)
    watcher.store = store
    ticks = iter(range(2, 100))
    real_sleep = time.sleep

    def sleep(seconds):  # the other live ranks' watchers tick meanwhile
        for r in live:
            store.set(f"moe-fold/heartbeat/alive/{r}", str(next(ticks)))
        real_sleep(seconds)

    monkeypatch.setattr(hb.time, "sleep", sleep)
    return watcher._diagnose(1, 6.0, 5.0)


def test_diagnosis_names_the_stopped_rank_not_the_ranks_waiting_for_it(monkeypatch):
    # Rank 2 stopped one beat ahead of the others' (it beat "step 7", then was stopped in
    # its forward; the others wait in the all-to-all with the same beat, or one behind).
    report = _diagnosis(monkeypatch, seqs=[12, 11, 12, 12], live=[1, 3])
    assert report["stalled"] == [2] and report["frozen"] and report["live"] == [0, 1, 3]


def test_diagnosis_with_every_rank_alive_names_the_least_advanced(monkeypatch):
    report = _diagnosis(monkeypatch, seqs=[12, 11, 12, 12], live=[1, 2, 3])
    assert report["stalled"] == [1] and not report["frozen"] and report["live"] == [0, 1, 2, 3]
    text = hb.describe(report, Path("/run/hang/step_000007"))
    assert text.startswith("hang: rank 1 of 4 made no progress since step 7 (step); every rank is alive")


# --------------------------------------------------------------------------- killing a stopped rank

def _stopped_child():
    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGSTOP)
    return child


def test_the_lowest_live_rank_on_its_host_kills_a_stopped_rank():
    """A SIGSTOPped process ends only by SIGKILL (torchrun's agent would wait 30 s after
    its SIGTERM): the lowest live rank on the stopped rank's host kills it; another live
    rank, a rank on another host, or a pid that now names another process (its start time
    differs) does not."""
    child = _stopped_child()
    try:
        me = hb.this_process()
        victim = {"host": me["host"], "pid": child.pid, "start": hb._start_time(child.pid)}
        report = {"stalled": [2], "frozen": True, "live": [0, 1, 3]}
        elsewhere = {0: {**me, "host": "other-host"}, 1: me, 2: victim, 3: me}
        assert hb.kill_stopped(report, elsewhere, me=3) == []  # rank 1 is the lowest on the host
        assert hb.kill_stopped(report, elsewhere, me=0) == []  # not rank 0's host
        assert hb.kill_stopped(report, {**elsewhere, 2: {**victim, "start": "1"}}, me=1) == []  # pid reused
        assert hb.kill_stopped({**report, "frozen": False}, elsewhere, me=1) == []  # alive: it waits, no kill
        assert child.poll() is None
        [line] = hb.kill_stopped(report, elsewhere, me=1)
        assert line == f"rank 1 killed stopped rank 2 (pid {child.pid} on {me['host']}) with SIGKILL"
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------- long phases

# Sleeps of SLOW seconds on rank 1, each well over the steps' budget (train.hang_timeout_s).
# A wrong budget of 2 s would name rank 1 after at most 2 + POLL_S + 3 POLL_S (the diagnosis)
# seconds, before it wakes.
SLOW, HANG_TIMEOUT = 7.0, 2.0


def _slow_phases_then_train(rank, world_size, config, slow_step):
    """Rank 1 sleeps SLOW seconds in the first step, the first and second saves, the first
    evaluation and the first re-placement (step 5, moe.replace_every=5); in step
    ``slow_step`` it stalls until the watch ends the run (however long a loaded machine
    takes to notice: a fixed sleep there would let a late detection miss the step)."""
    import moe_fold.training.evaluate as evaluate
    from moe_fold.training.checkpoint import CheckpointSaver
    from moe_fold.training.replace import ExpertReplacer
    from moe_fold.training.step import forward_backward
    from moe_fold.training.train import train

    calls: dict[str, int] = {}

    def slowed(name, fn, which, stall=frozenset()):
        def run(*args, **kwargs):
            # Training steps only: evaluation runs forward_backward too, forward_only.
            if not kwargs.get("forward_only"):
                calls[name] = calls.get(name, 0) + 1
                if rank == 1 and calls[name] in which:
                    time.sleep(SLOW)
                if rank == 1 and calls[name] in stall:
                    threading.Event().wait()  # until the hang watch ends this process
            return fn(*args, **kwargs)
        return run

    CheckpointSaver.save = slowed("save", CheckpointSaver.save, {1, 2})
    evaluate.evaluate = slowed("eval", evaluate.evaluate, {1})
    ExpertReplacer.after_step = slowed("replace", ExpertReplacer.after_step, {5})  # called every step
    return train(config, forward_backward=slowed("step", forward_backward, {1}, stall={slow_step})).losses


@pytest.mark.slow
def test_long_first_step_save_eval_and_replacement_do_not_fire_but_a_long_step_does(tmp_path, cache_dir):
    """hang_timeout_s=2 s; rank 1 spends 7 s in the first step, in the first two saves (at
    steps 3 and 6), in the first evaluation (step 4) and the first re-placement (step 5):
    none is named. A stall in step 8, an ordinary one, is: the one report of the run is of
    step 8, after at least the 2 s budget of silence."""
    from moe_fold.data.loader import dataset_from_config
    from moe_fold.launch import RankError, run_ranks

    extra = ["parallel.ep=2", "train.steps=9", "train.save_every=3", "train.eval_every=4", "train.eval_iters=1",
             "data.valid_fraction=0.1", "moe.replace_every=5", f"train.hang_timeout_s={HANG_TIMEOUT}",
             "parallel.timeout_s=60"]
    config = small_config(tmp_path, cache_dir, *extra)
    dataset_from_config(config)
    with pytest.raises(RankError, match=f"exit code {HANG_EXIT_CODE}"):
        run_ranks(_slow_phases_then_train, 2, config, slow_step=8, timeout=240)
    assert [p.name for p in (tmp_path / "hang").iterdir()] == ["step_000008"]
    report = (tmp_path / "hang" / "step_000008" / "report.txt").read_text()
    # Rank 1 sleeps in its forward (alive), rank 0 waits in the all-to-all: both are at
    # step 8, both alive.
    assert report.startswith("hang: rank 0 of 2 made no progress since step 8 (step); "
                             "rank 1 of 2 made no progress since step 8 (step); every rank is alive"), report
    detected = json.loads((tmp_path / "hang" / "step_000008" / "report.json").read_text())
    assert detected["budget_s"] == HANG_TIMEOUT and detected["silent_s"] >= HANG_TIMEOUT, detected
    assert [r["step"] for r in read_metrics(tmp_path) if "lm_loss" in r] == list(range(1, 8))
    for r in (0, 1):
        stacks = (tmp_path / "hang" / "step_000008" / f"stacks_rank_{r:05d}.txt").read_text()
        # Rank 1 in the test's sleep inside forward_backward, rank 0 in the step's collectives.
        assert "in _train" in stacks and ("in run" in stacks if r == 1 else "moe_fold/" in stacks), stacks


# --------------------------------------------------------------------------- SIGSTOP, for real

@pytest.mark.slow
def test_sigstopped_rank_is_named_in_seconds_and_the_restart_finishes_exactly(tmp_path, cache_dir):
    """SIGSTOP to rank 1 of `moe-fold train --nproc 2 --max-restarts 1` (ep2,
    hang_timeout_s=5, parallel.timeout_s=120): within 5 s + 15 s the launcher prints the
    report naming rank 1 and its last step; rank 0's stacks are in the run folder, rank 1
    (stopped) has none; the group is restarted from the newest checkpoint and the run
    ends with code 0 and the uninterrupted run's losses, bit for bit."""
    from moe_fold.data.loader import dataset_from_config

    steps, hang_timeout = 24, 5
    extra = ["parallel.ep=2", "parallel.timeout_s=120", f"train.hang_timeout_s={hang_timeout}",
             f"train.steps={steps}"]
    dataset_from_config(small_config(tmp_path / "straight", cache_dir))
    straight = subprocess.run(_cli("--nproc", "2", *_set(overrides(tmp_path / "straight", cache_dir, *extra))),
                              capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert straight.returncode == 0, straight.stderr

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(_cli("--nproc", "2", "--max-restarts", "1",
                                 *_set(overrides(run_dir, cache_dir, *extra))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 6, 240, "step 6", proc)
    rank0, rank1 = _rank_pids(proc.pid, metrics)
    os.kill(rank1, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            for pid in (rank0, rank1, proc.pid):
                with contextlib.suppress(ProcessLookupError):  # one may have ended meanwhile
                    os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    [report_file] = (run_dir / "hang").glob("step_*/report.json")
    report = json.loads(report_file.read_text())
    detected = report["time"] - stopped_at
    print(f"SIGSTOP to the named report: {detected:.1f} s")
    assert report["stalled"] == [1] and report["frozen"] and report["live"] == [0]
    last = report["beats"]["1"]["step"]
    message = " ".join(err.split())
    assert (f"error: training failed: hang: rank 1 of 2 made no progress since step {last} "
            f"({report['beats']['1']['phase']}); it is not running") in message, err
    assert "restarting the 2 ranks (1 of --max-restarts=1) from the newest checkpoint" in message, err
    # Rank 0, on the same host, killed it (torchrun's agent would wait 30 s after a SIGTERM).
    assert f"moe-fold: hang: rank 0 killed stopped rank 1 (pid {rank1} on " in err, err
    assert hang_timeout - 2 < detected < hang_timeout + 15, detected
    folder = report_file.parent
    assert folder.name == f"step_{last:06d}"
    assert sorted(p.name for p in folder.iterdir()) == ["report.json", "report.txt", "stacks_rank_00000.txt"]
    stacks = (folder / "stacks_rank_00000.txt").read_text()
    assert "Thread" in stacks and "moe_fold/training/heartbeat.py" in stacks and "train.py" in stacks, stacks
    # The restart continued from a checkpoint (a fresh start would give the same losses).
    assert f"resumed from {run_dir}/checkpoints/step_" in " ".join(out.split()), out[-3000:]
    assert _losses(run_dir) == _losses(tmp_path / "straight")
    assert [s for s, _ in _losses(run_dir)] == list(range(1, steps + 1))
    assert not Path(f"/proc/{rank1}").exists() or Path(f"/proc/{rank1}/stat").read_text().split()[2] == "Z"
