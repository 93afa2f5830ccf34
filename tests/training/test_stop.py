"""Long runs (issue 17): preemption signals, no orphans, budgets, automatic resume.

Real processes and real signals, as a scheduler sends them:

- SIGTERM to the `moe-fold train --nproc 2` launcher, SIGTERM to one rank, SIGINT to the
  launcher's process group (Ctrl-C): every rank stops after the same step, that step's
  checkpoint is written, the run exits 128 + the signal number with one line, no process
  is left; --resume then gives the uninterrupted run's losses bit for bit.
- A second Ctrl-C aborts at once (exit 130), even while a rank is stuck.
- SIGKILL to the launcher: the ranks, the forkserver and the resource tracker are gone
  within 10 s, and nothing writes into the run folder after.
- Budgets (train.exit_at_step, train.exit_after_minutes) and a signal in one process:
  exit 0 (budgets), a checkpoint of the step, an exact resume that skips partial checkpoints.
- torchrun: SIGTERM to the agent (which forwards it) stops the workers with a checkpoint;
  with --max-restarts 1, a killed worker makes torchrun restart the group, which resumes
  by itself and ends with the uninterrupted run's losses; an agent killed by any signal
  (SIGKILL included) leaves no worker running: each watches its agent, stops after its
  step with a checkpoint and is ended within seconds.
- Elastic torchrun (issue 28): two agents, ep=4 with parallel.elastic=true; one agent is
  killed for good and the other goes on with ep=2 on 2 ranks; it comes back and both
  finish with ep=4; the losses are the uninterrupted run's within the resharding tolerance.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from moe_fold.config import load_config
from moe_fold.training.checkpoint import latest_checkpoint
from moe_fold.training.stop import Stop
from moe_fold.training.train import read_metrics, train

# The small constant-lr Mixtral-style model of the reliability tests, a checkpoint every step.
from tests.training.test_reliability import SMALL, children, descendants, holds_open, overrides

EP2 = ["parallel.ep=2", "parallel.timeout_s=60"]
STEPS = 10  # the uninterrupted 2-rank run; interrupted runs are stopped well before
from tests.helpers.paths import REPO as ROOT


def _env(threads: int = 0) -> dict:
    """``threads`` per process (default: as many as this test process, for a run compared
    bit for bit with one made here). The ranks of --nproc set their own count, cores // N."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads or torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}


# torchrun's workers take OMP_NUM_THREADS: the count the ranks of --nproc 2 take, for the same sums.
NPROC2_THREADS = max(1, (os.cpu_count() or 1) // 2)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_fold.cli", "train", "--config", "mixtral-tiny", "--no-progress", *args]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args,
            "-m", "moe_fold.cli", "train", "--config", "mixtral-tiny", "--no-progress"]


def _set(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def _start(command: list[str], threads: int = 0, env: dict | None = None) -> subprocess.Popen:
    # A session of its own: the test's signals to "the process group" reach this run only.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(threads), **(env or {})}, cwd=ROOT, start_new_session=True)


def _wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while latest_checkpoint(run_dir) is None or not (run_dir / "metrics.jsonl").exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended (code {proc.returncode}) before its first checkpoint:\n{out}\n{err}")
        if time.monotonic() > deadline:
            _kill_all(proc)
            raise AssertionError("timed out waiting for the first checkpoint")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Running, or stopped; a zombie has ended (only its parent's wait is missing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# How long processes may take to end after what should end them: seconds when idle, more
# on a busy machine, still far below the hundreds of seconds left of their runs.
GONE_WITHIN_S = 60


def _kill(pid: int) -> None:
    """SIGKILL, for cleanup: the process may have ended since it was last seen."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _still_alive(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(proc: subprocess.Popen) -> None:
    for pid in descendants(proc.pid) + [proc.pid]:
        if _alive(pid):
            _kill(pid)


def _ranks(pids: list[int], metrics: Path) -> tuple[int, int]:
    """(rank 0, rank 1) among the processes of a 2-rank run: the rank processes are
    siblings, and rank 0 holds metrics.jsonl open."""
    writers = [p for p in pids if holds_open(p, metrics)]
    assert len(writers) == 1, writers
    parent = int(Path(f"/proc/{writers[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    siblings = [p for p in children(parent) if p != writers[0]]
    assert len(siblings) == 1, siblings
    return writers[0], siblings[0]


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc)
        out, err = proc.communicate()
        raise AssertionError(f"still running {timeout} s after the signal:\n{out[-2000:]}\n{err[-4000:]}")


def _stopped_step(run_dir: Path, err: str, signal_name: str) -> int:
    """The step the run stopped after: its last metrics record, its newest checkpoint
    (every rank's shard in it) and the one line it ended with agree on it."""
    step = read_metrics(run_dir)[-1]["step"]
    saved = latest_checkpoint(run_dir)
    assert saved is not None and saved.name == f"step_{step:06d}", (saved, step)
    index = json.loads((saved / "index.json").read_text())
    assert index["extra"]["step"] == step
    assert {"rank_00000.safetensors", "rank_00001.safetensors"} <= set(index["files"])
    assert (f"stopped after step {step} of 1000: {signal_name} received; checkpoint {saved}; continue with --resume"
            in err.strip().splitlines()[-1]), err
    return step


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir) -> list[tuple[int, float]]:
    """The uninterrupted 2-rank (ep2) run: (step, loss) of each of its STEPS steps."""
    run_dir = tmp_path_factory.mktemp("straight")
    done = subprocess.run(_cli("--nproc", "2", *_set(overrides(run_dir, cache_dir, *EP2, f"train.steps={STEPS}"))),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return _losses(run_dir)


def _resume_is_exact(run_dir: Path, cache_dir: str, straight: list, stopped: int) -> None:
    assert 1 <= stopped < STEPS, stopped
    resumed = subprocess.run(_cli("--nproc", "2", "--resume",
                                  *_set(overrides(run_dir, cache_dir, *EP2, f"train.steps={STEPS}"))),
                             capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:06d}" in " ".join(resumed.stdout.split())
    assert _losses(run_dir) == straight


# --------------------------------------------------------------------------- signals, --nproc

@pytest.mark.slow
@pytest.mark.parametrize("target, sig", [
    ("launcher", signal.SIGTERM),  # what SLURM, Kubernetes and systemd send to the job's process
    ("rank 1", signal.SIGTERM),  # one rank only: the others learn it through the step's all-reduce
    ("process group", signal.SIGINT),  # Ctrl-C in the terminal
    # Every process of the job, the forkserver included (systemd's control group, a SLURM
    # job step): the forkserver must survive it, or its ranks would be taken for dead.
    ("process group", signal.SIGTERM),
], ids=["launcher-SIGTERM", "rank1-SIGTERM", "group-SIGINT", "group-SIGTERM"])
def test_signal_stops_every_rank_after_one_step_with_its_checkpoint_and_resume_is_exact(
        tmp_path, cache_dir, straight, target, sig):
    run_dir = tmp_path / "run"
    proc = _start(_cli("--nproc", "2", *_set(overrides(run_dir, cache_dir, *EP2, "train.steps=1000"))))
    _wait_for_checkpoint(run_dir, proc)
    pids = descendants(proc.pid)  # the ranks, the forkserver, the resource tracker
    if target == "launcher":
        os.kill(proc.pid, sig)
    elif target == "rank 1":
        os.kill(_ranks(pids, run_dir / "metrics.jsonl")[1], sig)
    else:
        os.killpg(proc.pid, sig)
    out, err = _finish(proc, timeout=120)
    assert proc.returncode == 128 + sig, (out, err)
    assert "Traceback" not in out + err, err
    stopped = _stopped_step(run_dir, err, sig.name)
    assert _still_alive(pids, within=GONE_WITHIN_S) == []
    _resume_is_exact(run_dir, cache_dir, straight, stopped)


@pytest.mark.slow
def test_second_ctrl_c_aborts_at_once_even_with_a_stuck_rank(tmp_path, cache_dir):
    """Rank 1 stopped (SIGSTOP), so the graceful stop cannot finish: the first Ctrl-C waits
    for it, the second kills every rank at once (long before parallel.timeout_s would end
    the wait); exit 130, one line, no process left."""
    run_dir = tmp_path / "run"
    proc = _start(_cli("--nproc", "2", *_set(overrides(run_dir, cache_dir, *EP2, "parallel.timeout_s=600",
                                                       "train.steps=1000"))))
    _wait_for_checkpoint(run_dir, proc)
    pids = descendants(proc.pid)
    os.kill(_ranks(pids, run_dir / "metrics.jsonl")[1], signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None  # waiting for the stuck rank to reach the step boundary
    os.killpg(proc.pid, signal.SIGINT)
    out, err = _finish(proc, timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines()[-1].startswith("aborted: Ctrl-C killed the 2 ranks"), err
    assert "Traceback" not in err
    assert _still_alive(pids, within=GONE_WITHIN_S) == []


@pytest.mark.slow
def test_killed_launcher_leaves_no_process_and_no_writer(tmp_path, cache_dir):
    """SIGKILL to the launcher (no handler can run): every rank exits with it, then the
    forkserver and the resource tracker; metrics.jsonl and the checkpoints stop changing."""
    run_dir = tmp_path / "run"
    proc = _start(_cli("--nproc", "2", *_set(overrides(run_dir, cache_dir, *EP2, "train.steps=1000"))))
    _wait_for_checkpoint(run_dir, proc)
    pids = descendants(proc.pid)
    assert len(pids) >= 3, pids  # 2 ranks and the forkserver (and the resource tracker)
    proc.kill()
    proc.communicate(timeout=30)
    left = _still_alive(pids, within=GONE_WITHIN_S)
    for pid in left:
        _kill(pid)
    assert left == []
    def files():
        return sorted((str(p), p.stat().st_size) for p in run_dir.rglob("*") if p.is_file())

    before = files()
    time.sleep(1.0)
    assert files() == before


# --------------------------------------------------------------------------- budgets, one process

def test_budgets_and_a_signal_stop_with_a_checkpoint_and_resume_is_exact(tmp_path, cache_dir):
    """4 steps straight equal: the CLI stopped by train.exit_at_step=1 (exit 0, one line);
    SIGUSR1 during step 2 (a stop after step 2); train.exit_after_minutes (after step 3,
    the first check); a resume that skips two partial checkpoints of later steps."""
    from moe_fold.training.step import forward_backward

    run_dir = tmp_path / "run"

    def config(*extra):
        return load_config("mixtral-tiny", overrides(run_dir, cache_dir, "train.steps=4", *extra))

    straight = train(load_config("mixtral-tiny", overrides(tmp_path / "straight", cache_dir, "train.steps=4")))

    cli = subprocess.run(_cli(*_set(overrides(run_dir, cache_dir, "train.steps=4", "train.exit_at_step=1"))),
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == (
        f"stopped after step 1 of 4: train.exit_at_step=1 reached; checkpoint {run_dir}/checkpoints/step_000001; "
        f"continue with --resume")
    again = train(config("train.exit_at_step=1"), resume=True)  # already there: no step
    assert again.losses == [] and again.stop == Stop(1, "train.exit_at_step=1 reached", 0)

    def signalled_in_step_2(*args, **kwargs):
        if len(read_metrics(run_dir)) == 1:
            signal.raise_signal(signal.SIGUSR1)
        return forward_backward(*args, **kwargs)

    signalled = train(config(), resume=True, forward_backward=signalled_in_step_2)
    assert signalled.stop == Stop(2, "SIGUSR1 received", 128 + signal.SIGUSR1)
    assert Path(signalled.checkpoint).name == "step_000002" and len(signalled.losses) == 1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler lived for the run only

    timed = train(config("train.exit_after_minutes=1e-9"), resume=True)
    assert timed.stop == Stop(3, "train.exit_after_minutes=1e-09 reached", 0) and len(timed.losses) == 1
    # Partial checkpoints of later steps: a save that did not finish, a folder without index.json.
    (run_dir / "checkpoints" / "step_000004.tmp-0badc0de").mkdir()
    (run_dir / "checkpoints" / "step_000005").mkdir()
    last = train(config(), resume=True)
    assert last.first_step == 4 and last.stop is None
    assert _losses(run_dir) == _losses(tmp_path / "straight")
    assert [loss for _, loss in _losses(run_dir)] == straight.losses


# --------------------------------------------------------------------------- torchrun

def _workers(agent: int, metrics: Path) -> tuple[int, int]:
    """(rank 0, rank 1): the agent's worker processes; rank 0 holds metrics.jsonl open."""
    workers = children(agent)
    assert len(workers) == 2, workers
    first = [p for p in workers if holds_open(p, metrics)]
    assert len(first) == 1, first
    return first[0], next(p for p in workers if p != first[0])


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_by_itself(tmp_path, cache_dir, straight):
    """torchrun --max-restarts 1, no --resume: SIGKILL to one worker after the first
    checkpoint; torchrun restarts the group, which resumes from the newest checkpoint
    (TORCHELASTIC_RESTART_COUNT > 0) and ends with the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    proc = _start(_torchrun("--max-restarts", "1") + _set(overrides(run_dir, cache_dir, *EP2,
                                                                    f"train.steps={STEPS}")),
                  threads=NPROC2_THREADS)
    _wait_for_checkpoint(run_dir, proc)
    os.kill(_workers(proc.pid, run_dir / "metrics.jsonl")[1], signal.SIGKILL)
    out, err = _finish(proc, timeout=300)
    assert proc.returncode == 0, (out[-2000:], err[-4000:])
    assert "failed (exitcode: -9) local_rank: 1" in err
    resumed = " ".join(out.split())
    assert f"resumed from {run_dir}/checkpoints/step_" in resumed, out
    assert _losses(run_dir) == straight


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_the_workers_with_a_checkpoint_and_resume_is_exact(tmp_path, cache_dir, straight):
    """SIGTERM to the torchrun agent, which passes it on to its workers: they stop after
    the same step with its checkpoint (rank 0's one line says so) within the agent's
    grace period; --resume (here with --nproc 2) repeats the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    proc = _start(_torchrun() + _set(overrides(run_dir, cache_dir, *EP2, "train.steps=1000")), threads=NPROC2_THREADS)
    _wait_for_checkpoint(run_dir, proc)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc, timeout=120)
    assert proc.returncode != 0  # torchrun reports the signal it was ended by
    assert "Unable to shutdown process" not in err  # no worker needed the agent's SIGKILL
    stopped = _stopped_step(run_dir, "\n".join(line for line in err.splitlines() if line.startswith("stopped")),
                            "SIGTERM")
    assert _still_alive(workers, within=GONE_WITHIN_S) == []
    _resume_is_exact(run_dir, cache_dir, straight, stopped)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_workers_of_a_dead_torchrun_agent_stop_within_seconds(tmp_path, cache_dir, sig):
    """The torchrun agent dies (SIGKILL: no handler runs, and torchrun puts each worker in a
    session of its own, so nothing else reaches them; SIGINT: the agent ends them itself).
    Every worker is gone within seconds and metrics.jsonl stops growing. After SIGKILL each
    worker's agent watch stops it after its step with that step's checkpoint first."""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    proc = _start(_torchrun() + _set(overrides(run_dir, cache_dir, *EP2, "train.steps=1000")), threads=NPROC2_THREADS)
    workers: list[int] = []
    try:
        _wait_for_checkpoint(run_dir, proc)
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        size = metrics.stat().st_size
        deadline = time.monotonic() + 60
        while metrics.stat().st_size == size and time.monotonic() < deadline:  # training, not starting
            time.sleep(0.02)
        assert metrics.stat().st_size > size
        proc.send_signal(sig)
        sent = time.monotonic()
        left = _still_alive(workers, within=GONE_WITHIN_S)
        took = time.monotonic() - sent
        assert left == [], f"workers {left} still running {GONE_WITHIN_S} s after {sig.name} to their agent"
        print(f"workers gone {took:.2f} s after {sig.name} to the agent")
        out, err = _finish(proc, timeout=30)
        size = metrics.stat().st_size
        time.sleep(1.0)
        assert metrics.stat().st_size == size
        if sig == signal.SIGKILL:
            assert f"the torchrun agent (pid {proc.pid}) is gone: stopping this rank (SIGTERM)" in err, err[-4000:]
            stopped = [line for line in err.splitlines() if line.startswith("stopped")]
            _stopped_step(run_dir, "\n".join(stopped), "SIGTERM")
    finally:
        for pid in [*workers, *descendants(proc.pid), proc.pid]:
            if _alive(pid):
                _kill(pid)
        if proc.returncode is None:
            proc.communicate(timeout=30)


# --------------------------------------------------------------------------- elastic torchrun

# Enough steps that the survivors (2 ranks step fast here: ~2 steps/s) are still training
# when the returned node has joined (~20 s after its agent starts on a loaded 2-core machine).
ELASTIC_STEPS = 80
# ep=4 cannot run on the 2 ranks left when a node is lost (issue 28: the job died at step 14
# of 30): with parallel.elastic=true the survivors take ep=2. 8 samples a step: 1 micro-batch
# per rank on 4 ranks, 2 on 2.
ELASTIC = ["parallel.ep=4", "parallel.timeout_s=60", "train.global_batch_size=8", f"train.steps={ELASTIC_STEPS}"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The rendezvous settings docs/reliability.md ("Elastic restarts") gives for an elastic job,
# as bench/goodput.py runs it: a dead node is dropped after 3 keep-alives of 2 s missed,
# and a round closes 5 s after its minimum of nodes joined (torch: 3 x 5 s and 30 s).
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=5"


def _elastic_agent(port: int, host: bool, run_dir: Path, cache_dir: str) -> subprocess.Popen:
    """One torchrun "node": 2 workers, 1 to 2 nodes, c10d rendezvous on 127.0.0.1. The
    first agent hosts the rendezvous store (is_host), so it must be the one that survives."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "elastic-test", "--rdzv-conf", f"is_host={str(host).lower()},{RDZV_CONF}",
               "-m", "moe_fold.cli", "train", "--config", "mixtral-tiny", "--no-progress",
               *_set(overrides(run_dir, cache_dir, *ELASTIC, "parallel.elastic=true"))]
    # torch's shared rendezvous store cannot take back a node that left (its agent waits for
    # the store address the first node no longer publishes): docs/reliability.md.
    return _start(command, threads=1, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _elastic_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "elastic.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_until(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            outputs = []
            for p in procs:
                _kill_all(p)
                out, err = p.communicate()
                outputs.append(f"--- agent {p.pid} (code {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}")
            raise AssertionError(f"{'an agent ended' if ended else 'timed out'} waiting for {what}\n" + "\n".join(outputs))
        time.sleep(0.05)


def _steps_done(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=0)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line half written
        return 0


@pytest.mark.slow
def test_elastic_torchrun_loses_a_node_for_good_then_grows_back(tmp_path, cache_dir):
    """Two torchrun agents (2 workers each) train ep=4 on 4 ranks with parallel.elastic=true.
    One agent and its workers are killed (SIGKILL) for good: the other restarts alone, on
    2 ranks with ep=2 (the largest ep that fits), resumes from the newest checkpoint and
    trains on; the killed agent is started again: both restart together on 4 ranks with
    ep=4 and finish. Each start's layout is in elastic.jsonl. The 5 steps after each resume
    take the uninterrupted 4-rank run's losses within the resharding tolerance (a wrong
    checkpoint, data position or reshard is off by 1e-3 or more there); every step is within
    1% of it.

    Not every step within 1e-5: 2 ranks sum in another order than 4 (2e-8 relative), and
    80 steps of a tiny MoE amplify that until a token's top-k flips (seen: 3.6e-7 up to
    step 61, 1.9e-4 at step 62, 4e-3 at step 79)."""
    straight_dir = tmp_path / "straight"
    done = subprocess.run(_cli("--nproc", "4", *_set(overrides(straight_dir, cache_dir, *ELASTIC))),
                          capture_output=True, text=True, env=_env(1), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    straight = dict(_losses(straight_dir))

    run_dir = tmp_path / "run"
    port = _free_port()
    began = time.monotonic()
    first = _elastic_agent(port, True, run_dir, cache_dir)
    time.sleep(1.0)  # the first agent hosts the rendezvous store
    lost = _elastic_agent(port, False, run_dir, cache_dir)
    back = None
    try:
        _wait_until("3 steps on 4 ranks", lambda: _steps_done(run_dir) >= 3, [first, lost])
        assert [r["world_size"] for r in _elastic_rows(run_dir)] == [4]
        _kill_all(lost)  # the agent and its workers, for good
        killed = time.time()
        lost.communicate(timeout=30)
        killed_at = _steps_done(run_dir)
        _wait_until("a step on the 2 ranks left", lambda: len(_elastic_rows(run_dir)) == 2
                    and _steps_done(run_dir) > killed_at + 1, [first])
        grown_at = _steps_done(run_dir)
        back = _elastic_agent(port, False, run_dir, cache_dir)
        returned = time.time()
        out, err = _finish(first, timeout=300)
        assert first.returncode == 0, (out[-3000:], err[-6000:])
        back_out, back_err = _finish(back, timeout=60)
        assert back.returncode == 0, (back_out[-3000:], back_err[-6000:])
    finally:
        for p in (first, lost, back):
            if p is not None and p.returncode is None:
                _kill_all(p)
                p.communicate(timeout=30)
    seconds = time.monotonic() - began
    rows = _elastic_rows(run_dir)
    assert [(r["world_size"], r["rule"], r["ep"], r["dp"], r["micro_batches"]) for r in rows] == [
        (4, "configured", 4, 4, 1), (2, "largest ep", 2, 2, 2), (4, "configured", 4, 4, 1)], rows
    printed = " ".join((out + back_out).split())
    assert "elastic layout: world_size=2: the configured layout (tp=1 cp=1 pp=1 ep=4 etp=1) does not fit" in printed
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, ELASTIC_STEPS + 1))  # resumes rewrote nothing twice
    # The step each start resumed after (rank 0's line): the survivors', then the grown world's.
    resumed = [int(s) for s in re.findall(r"resumed from \S+/step_(\d+)", printed)]
    assert len(resumed) == 2 and killed_at - 1 <= resumed[0] <= killed_at + 1 and resumed[1] >= grown_at, resumed
    # The grown world trained too: it resumed from a checkpoint of the survivors, 10 steps or more before the end.
    assert resumed[1] <= ELASTIC_STEPS - 10, resumed
    relative = {r["step"]: abs(r["loss"] - straight[r["step"]]) / abs(straight[r["step"]]) for r in metrics}
    after_resumes = [s for r in resumed for s in range(r + 1, r + 6)]
    near, worst = max(relative[s] for s in after_resumes), max(relative.values())
    print(f"elastic: lost a node after step {killed_at} (resumed after {resumed[0]}), started it again after "
          f"step {grown_at} (all resumed after {resumed[1]}); "
          f"{ELASTIC_STEPS} steps in {seconds:.0f} s; the 2-rank start {rows[1]['time'] - killed:.1f} s after the "
          f"kill, the 4-rank start {rows[2]['time'] - returned:.1f} s after the agent's return; "
          f"max relative loss difference {near:.2e} after the resumes, {worst:.2e} over the run")
    assert near <= 1e-5 and worst <= 1e-2
