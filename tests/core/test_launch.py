"""The multi-rank harness itself: results, errors, dead ranks, timeouts, no leftovers."""

import contextlib
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from moe_fold.launch import RankError, run_ranks

from tests.helpers.paths import REPO


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _die_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return os.getpid()


def _sleep_forever(rank, world_size):
    time.sleep(600)


def _pid(rank, world_size):
    return os.getpid()


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_results_come_back_in_rank_order(world_size):
    out = run_ranks(_sum_of_ranks, world_size, 2.0)
    expected = 2.0 * sum(range(world_size))
    assert out == [expected] * world_size


def test_exception_carries_rank_and_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in str(info.value)


def test_dead_rank_is_reported_not_hung():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_die_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "exit code 7" in str(info.value)
    assert time.monotonic() - start < 30


def test_timeout_kills_every_rank():
    with pytest.raises(RankError, match="timed out after 3s"):
        run_ranks(_sleep_forever, 2, timeout=3)


def test_no_process_left_behind():
    pids = run_ranks(_pid, 2)
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(OSError):
            os.kill(pid, 0)


def _tensor_result(rank, world_size):
    return {"rank": rank, "values": torch.arange(4.0) * rank}


def test_tensor_results_survive_the_rank_process():
    out = run_ranks(_tensor_result, 2)
    assert [o["rank"] for o in out] == [0, 1]
    torch.testing.assert_close(out[1]["values"], torch.tensor([0.0, 1.0, 2.0, 3.0]))


def _wait_for_a_signal(rank, world_size):
    from moe_fold.training.stop import ExitSignals

    with ExitSignals(["SIGUSR1"]) as signals:
        deadline = time.monotonic() + 60
        while not signals.received and time.monotonic() < deadline:
            time.sleep(0.01)
    return signals.received, os.getpgid(0) == os.getpid()


def test_forwarded_signal_reaches_every_rank_once_in_its_own_process_group():
    """SIGUSR1 to the parent (whenever it comes: before, while or after the ranks start) is
    passed on to each rank, which runs in a process group of its own."""
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    out = run_ranks(_wait_for_a_signal, 2, timeout=120, forward_signals=[signal.SIGUSR1])
    assert out == [(signal.SIGUSR1, True)] * 2
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the parent's handler is gone


def _sleep_then_report(rank, world_size, marker):
    # Written whole, then renamed: the test never reads a half-written pid.
    open(f"{marker}.{rank}.tmp", "w").write(str(os.getpid()))
    os.replace(f"{marker}.{rank}.tmp", f"{marker}.{rank}")
    time.sleep(600)


# How long a rank may take to exit once its launcher is gone: far below the 600 s sleep,
# far above the few seconds it takes on a busy machine.
EXIT_BOUND_S = 60.0


def _wait_gone(pids, bound_s, since):
    """The pids of ``pids`` still running ``bound_s`` seconds after ``since`` (a
    time.monotonic()), each awaited on a pidfd (readable once the process has ended, so no
    poll interval and no pid reuse); those still running are then killed through their
    pidfd. A process already gone when it is looked at counts as gone."""
    import select

    handles = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            handles[pid] = os.pidfd_open(pid)
    try:
        while handles and time.monotonic() < since + bound_s:
            ready, _, _ = select.select(list(handles.values()), [], [], max(0.0, since + bound_s - time.monotonic()))
            for pid in [p for p, fd in handles.items() if fd in ready]:
                os.close(handles.pop(pid))
        return sorted(handles)
    finally:
        for fd in handles.values():  # still running after the bound: the test fails, nothing stays behind
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)

_LAUNCHER = """
import sys
from moe_fold.launch import run_ranks
from tests.core.test_launch import _sleep_then_report
run_ranks(_sleep_then_report, 2, sys.argv[1], timeout=600)
"""


def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to a process inside run_ranks: its ranks exit (each watches its parent), and
    so does the forkserver, long before the 600 s they would otherwise sleep. Each exit is
    awaited on a pidfd (readable once the process has ended), so a loaded machine only
    makes them late; the bound, EXIT_BOUND_S, is a tenth of the sleep they would finish
    without the watch. A pid is taken before the kill, so a rank already gone is no race."""
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "rank"
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(marker)],
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not all(Path(f"{marker}.{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        assert proc.poll() is None, f"the launcher ended with {proc.returncode} before its ranks started"
        time.sleep(0.05)
    ranks = [int(Path(f"{marker}.{r}").read_text()) for r in range(2)]
    forkserver = int(Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    killed_at = time.monotonic()
    proc.kill()
    proc.wait()
    left = _wait_gone(ranks + [forkserver], EXIT_BOUND_S, killed_at)
    print(f"ranks and forkserver gone {time.monotonic() - killed_at:.1f} s after the launcher's SIGKILL")
    assert left == [], f"still running {EXIT_BOUND_S} s after their launcher was killed: {left}"


# A parent that starts a child and waits; the child watches it with a clean stop first
# (as torchrun's workers do), but only notes the stop signal and goes on, as a rank blocked
# in a collective whose peer is gone would.
_WATCHED_CHILD = """
import os, signal, sys, time
from moe_fold.launch import exit_with_parent, parent_handle
gone = parent_handle()
signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1] + ".stop", "w").close())
exit_with_parent(gone, who="the test's parent", stop_signal=signal.SIGUSR1, grace_s=float(sys.argv[2]))
open(sys.argv[1] + ".pid.tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".pid.tmp", sys.argv[1] + ".pid")  # whole, never half-written
time.sleep(600)
"""
_PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], start_new_session=True)
time.sleep(600)
"""


def test_a_watched_process_is_told_to_stop_then_ended_when_its_parent_is_killed(tmp_path):
    """exit_with_parent with a stop signal (torchrun's workers): SIGKILL to the parent, and
    the child (in a session of its own, as torchrun starts workers) gets the stop signal at
    once and is ended grace_s later although it ignored it."""
    import subprocess
    import sys
    from pathlib import Path

    marker, grace = str(tmp_path / "child"), 1.0
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _WATCHED_CHILD, marker, str(grace)])
    child = None
    try:
        deadline = time.monotonic() + 60
        while not Path(marker + ".pid").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        child = int(Path(marker + ".pid").read_text())
        killed = time.monotonic()  # before the kill: the child cannot start its grace earlier
        parent.kill()
        parent.wait()
        left = _wait_gone([child], grace + EXIT_BOUND_S, killed)
        took = time.monotonic() - killed
        assert left == [], f"the child outlived its parent by {grace + EXIT_BOUND_S} s"
        assert Path(marker + ".stop").exists(), "the child was never told to stop"
        # Not before its grace: it had a chance to stop cleanly; then ended, not left to
        # sleep its 600 s (a busy machine only makes the end late).
        assert grace <= took < grace + EXIT_BOUND_S, took
    finally:
        for pid in [child] if child else []:
            with contextlib.suppress(ProcessLookupError):  # it may end between any check and the kill
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
