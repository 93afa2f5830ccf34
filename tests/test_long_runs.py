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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_fold.config import load_config
from moe_fold.training.checkpoint import latest_checkpoint
from moe_fold.training.stop import Stop
from moe_fold.training.train import read_metrics, train

# The small constant-lr Mixtral-style model of the reliability tests, a checkpoint every step.
from test_reliability import SMALL, children, descendants, holds_open, overrides

EP2 = ["parallel.ep=2", "parallel.timeout_s=60"]
STEPS = 10  # the uninterrupted 2-rank run; interrupted runs are stopped well before
ROOT = Path(__file__).resolve().parents[1]


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


def _start(command: list[str], threads: int = 0) -> subprocess.Popen:
    # A session of its own: the test's signals to "the process group" reach this run only.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(threads),
                            cwd=ROOT, start_new_session=True)


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


def _still_alive(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(proc: subprocess.Popen) -> None:
    for pid in descendants(proc.pid) + [proc.pid]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


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
    assert _still_alive(pids, within=10) == []
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
    assert _still_alive(pids, within=10) == []


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
    left = _still_alive(pids, within=10)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
    def files():
        return sorted((str(p), p.stat().st_size) for p in run_dir.rglob("*") if p.is_file())

    before = files()
    time.sleep(1.0)
    assert files() == before


# --------------------------------------------------------------------------- budgets, one process

def test_budgets_and_a_signal_stop_with_a_checkpoint_and_resume_is_exact(tmp_path, cache_dir, monkeypatch):
    """4 steps straight equal: the CLI stopped by train.exit_at_step=1 (exit 0, one line);
    SIGUSR1 during step 2 (a stop after step 2); train.exit_after_minutes (after step 3,
    the first check); a resume that skips two partial checkpoints of later steps."""
    import moe_fold.training.step as step_module

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

    forward_backward = step_module.forward_backward

    def signalled_in_step_2(*args, **kwargs):
        if len(read_metrics(run_dir)) == 1:
            signal.raise_signal(signal.SIGUSR1)
        return forward_backward(*args, **kwargs)

    monkeypatch.setattr(step_module, "forward_backward", signalled_in_step_2)
    signalled = train(config(), resume=True)
    monkeypatch.undo()
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
    assert _still_alive(workers, within=10) == []
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
        left = _still_alive(workers, within=20)
        took = time.monotonic() - sent
        assert left == [], f"workers {left} still running 20 s after {sig.name} to their agent"
        print(f"workers gone {took:.2f} s after {sig.name} to the agent")
        assert took < 10, took
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
                os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.communicate(timeout=30)
