"""Hang detection: every rank beats its progress into the rendezvous store, and a watcher
thread on every rank names a rank that stopped making progress, long before a collective
times out (``parallel.timeout_s``).

Beats. The training loop calls :meth:`Heartbeat.beat` as it enters each phase of a step
(``step``, then ``replace``, ``eval``, ``save`` when they run, and ``finish`` after the
last step). A beat is a ``store.set`` of ``{seq, step, phase, budget_s}`` under
``moe-fold/heartbeat/progress/<rank>``, written at once when the phase changes and, for a
run of ``step`` beats, at most every :data:`POLL_S` seconds; the rank's watcher thread
writes the newest beat not yet written on each of its ticks. So a rank puts a few writes a
second on the store whatever its step time (one per step of 50 ms on 8192 ranks would be
160k a second on one store), and a stored beat is never more than a tick behind.

Budgets (how long a phase may last before its rank counts as stalled), chosen by the rank
that beats, from its own measured durations (the time from a phase's beat to the next beat):

- a phase this rank has never completed (the first step: lazy initialisation, the first
  all-to-alls; the first save; the first evaluation; ``finish``): ``parallel.timeout_s``,
  the collective timeout, as before this watch existed;
- ``step`` afterwards: ``train.hang_timeout_s`` when set; by default (None)
  ``max(30 s, 10 x the longest of the last 20 step durations)``;
- ``save``, ``eval``, ``replace`` afterwards: ``max(30 s, 10 x their longest of the last
  20)``; with ``train.hang_timeout_s`` set, ``max(train.hang_timeout_s, 10 x their longest)``.

So a checkpoint, an evaluation or a re-placement that is slow but normal never fires it,
and a step that suddenly takes ten times its usual time does. ``train.hang_timeout_s=0``
turns the watch off; a single process has nothing to watch.

Watching. Each rank's thread, every :data:`POLL_S` seconds, bumps its own ``alive`` counter
and reads the progress beat of the next rank (``(rank + 1) % world``): N ranks cost O(N)
store reads, and every rank is watched by one other. Once a neighbour's beat has not
changed for longer than the budget it announced, the watcher diagnoses (every rank's beats
and two readings of every ``alive`` counter ``3 x POLL_S`` apart):

- a rank whose ``alive`` counter did not move has no running thread at all: stopped
  (SIGSTOP), frozen, or its host gone. It is the one named;
- when every rank is alive, the ranks least advanced (fewest beats) are named: the others
  wait for them in a collective. (When all are at the same beat, a deadlock or a stuck
  kernel, all are named: their stacks say where each one waits.)

A neighbour that beats again during the diagnosis is let go (late, not hung). The first
diagnosis wins (``compare_set`` of ``moe-fold/heartbeat/hang``). Every rank's
watcher polls that key; each live rank then writes its Python stacks (``faulthandler``,
all threads) to ``<run_dir>/hang/step_<S>/stacks_rank_<R>.txt``, the rank that diagnosed
writes ``report.txt`` there and prints it to stderr, and once every live rank has written
its stacks (at most :data:`DUMP_WAIT_S`), each exits with :data:`HANG_EXIT_CODE`, so that
torchrun (``--max-restarts``) or ``moe-fold train --nproc --max-restarts`` restarts the
group from its newest checkpoint.

A stopped rank cannot write its own stacks (none of its threads runs), and it cannot end
on a SIGTERM either: torchrun's agent, stopping its workers, would wait its fixed 30 s
grace before the SIGKILL that ends it. So every rank publishes its process (host, pid and
start time) in the store when its watch begins, and the lowest live rank on the same host
as a stopped one kills it (SIGKILL) before exiting, once the pid is still that process
(same start time): the agent then finds every worker ended and restarts at once. A stopped
rank with no live rank on its host (its whole host stopped or gone) is left to its
launcher.

The store is the process group's (``torch.distributed``'s default store): under
``--nproc`` it lives in the launcher, under torchrun in the agent, so a stopped rank does
not take it with it. (Where rank 0 hosts the store, torchrun without the agent's store, a
stopped rank 0 stalls every watcher's reads until the store's timeout.)
"""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["Heartbeat", "HANG_EXIT_CODE", "kill_stopped", "this_process", "POLL_S", "FLOOR_S", "FACTOR", "read_report"]

# The exit code of a rank ended by the watch: EX_TEMPFAIL of sysexits.h ("temporary
# failure, retry"): what a restart is for.
HANG_EXIT_CODE = 75
# How often each watcher reads its neighbour's beat and bumps its own alive counter.
POLL_S = 1.0
# Default budgets: FACTOR x the longest of a phase's last WINDOW durations, at least FLOOR_S.
FLOOR_S = 30.0
FACTOR = 10.0
WINDOW = 20
# How long a live rank waits, after writing its stacks, for the other live ranks' stacks.
DUMP_WAIT_S = 10.0
# A rank told to stop may take this many times its longest recent step plus save.
STOP_GRACE_FACTOR = 3.0

_PREFIX = "moe-fold/heartbeat"
_HANG_KEY = f"{_PREFIX}/hang"
_DUMPED_KEY = f"{_PREFIX}/dumped"


def _progress_key(rank: int) -> str:
    return f"{_PREFIX}/progress/{rank}"


def _alive_key(rank: int) -> str:
    return f"{_PREFIX}/alive/{rank}"


def _process_key(rank: int) -> str:
    return f"{_PREFIX}/process/{rank}"


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, field 22 of /proc/PID/stat): with
    the pid, it names one process (a pid can be reused, the pair cannot). None where
    there is no /proc or no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def this_process() -> dict:
    """What another rank needs to kill this process if it stops: host, pid, start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def kill_stopped(report: dict, processes: dict[int, dict], me: int) -> list[str]:
    """SIGKILL to each stopped rank of ``report`` (``frozen``) that rank ``me`` is the
    lowest live rank on the host of (``processes``: rank -> :func:`this_process` of that
    rank), once its pid still names the same process (its start time). Returns one line
    per process killed."""
    if not report["frozen"]:
        return []
    said = []
    for rank in report["stalled"]:
        victim = processes.get(rank)
        if victim is None:
            continue
        neighbours = [r for r in report["live"] if processes.get(r, {}).get("host") == victim["host"]]
        if not neighbours or min(neighbours) != me:
            continue  # another host's, or another live rank's to kill
        if victim["start"] is None or _start_time(victim["pid"]) != victim["start"]:
            continue  # no way to tell it is still that process: left to the launcher
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        said.append(f"rank {me} killed stopped rank {rank} (pid {victim['pid']} on {victim['host']}) with SIGKILL")
    return said


class Heartbeat:
    """One rank's beats and watcher thread (see the module docstring).

    ``store``: the process group's store (None: nothing is watched, :meth:`beat` only
    measures). ``hang_timeout_s``: ``train.hang_timeout_s`` (None: derived, 0: off).
    ``first_budget_s``: the budget of a phase not yet measured (``parallel.timeout_s``).
    """

    def __init__(self, store: Any, rank: int, world_size: int, run_dir: Path,
                 hang_timeout_s: Optional[float], first_budget_s: float):
        self.store = store if world_size > 1 and hang_timeout_s != 0 else None
        self.rank, self.world_size = rank, world_size
        self.run_dir = Path(run_dir)
        self.hang_timeout_s = hang_timeout_s
        self.first_budget_s = first_budget_s
        self.durations: dict[str, collections.deque] = {}
        self._seq = 0
        self._phase: Optional[tuple[int, str]] = None  # (step, phase) of the last beat
        self._since = 0.0  # time.monotonic() of the last beat
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the beat to write: the loop's and the watcher's
        self._unwritten: Optional[tuple[str, str]] = None  # (phase, beat) of the newest, while not yet stored
        self._written: tuple[str, float] = ("", 0.0)  # phase and time.monotonic() of the last write
        self._alive = 0  # this rank's alive counter (the watcher thread's)
        self._thread: Optional[threading.Thread] = None
        self._store_lost = False  # a beat found the store gone
        if self.store is not None:
            self.store.set(_process_key(rank), json.dumps(this_process()))
            self._thread = threading.Thread(target=self._watch, name="moe-fold-hang-watch", daemon=True)
            self._thread.start()

    @classmethod
    def for_run(cls, config, rank: int, world_size: int) -> "Heartbeat":
        """The heartbeat of this rank of a training run (the default store of
        torch.distributed; none in a single process)."""
        store = None
        if world_size > 1:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
        return cls(store, rank, world_size, Path(config.train.run_dir), config.train.hang_timeout_s,
                   config.parallel.timeout_s)

    # ------------------------------------------------------------------ the beating side

    def stop_grace_s(self, floor_s: float) -> float:
        """Seconds a rank told to stop may take to finish its step and save that step's
        checkpoint: STOP_GRACE_FACTOR x (its longest recent step + its longest recent
        save), at least ``floor_s``. Only finished phases count, so a rank hung in one
        still gets a finite grace. Safe to call from another thread."""
        def longest(phase):
            return max(list(self.durations.get(phase, ())), default=0.0)

        return max(floor_s, STOP_GRACE_FACTOR * (longest("step") + longest("save")))

    def budget(self, phase: str) -> float:
        """Seconds ``phase`` may last before this rank counts as stalled."""
        seen = self.durations.get(phase)
        if not seen:
            return self.first_budget_s
        derived = FACTOR * max(seen)
        if self.hang_timeout_s:  # set by the user: no floor of ours
            return self.hang_timeout_s if phase == "step" else max(self.hang_timeout_s, derived)
        return max(FLOOR_S, derived)

    def beat(self, step: int, phase: str) -> None:
        """This rank enters ``phase`` of ``step``: closes the previous phase's duration and
        tells the watchers (one store write)."""
        now = time.monotonic()
        if self._phase is not None:
            self.durations.setdefault(self._phase[1], collections.deque(maxlen=WINDOW)).append(now - self._since)
        self._phase, self._since = (step, phase), now
        self._seq += 1
        if self.store is None or self._store_lost:
            return
        budget = self.budget(phase)
        value = json.dumps({"seq": self._seq, "step": step, "phase": phase, "budget_s": budget})
        try:
            with self._lock:
                self._unwritten = (phase, value)
                last_phase, last_time = self._written
                if phase != last_phase or now - last_time >= min(POLL_S, budget / 4):
                    self._write_beat(now)
        except Exception as e:
            # The store is gone with the launcher or agent that held it: the run is stopping
            # on its own (launch.exit_with_parent), and a stop still saves its checkpoint, so
            # a beat never fails the step; nothing watches any more.
            self._store_lost = True
            print(f"moe-fold: rank {self.rank}: hang watch off: the store is gone ({type(e).__name__}: {e})",
                  file=sys.stderr)

    def _write_beat(self, now: float) -> None:
        """Store the newest beat (the caller holds ``_lock``)."""
        phase, value = self._unwritten
        self.store.set(_progress_key(self.rank), value)
        self._unwritten, self._written = None, (phase, now)

    def close(self) -> None:
        """This rank is done: its watcher stops and its neighbour stops expecting beats."""
        if self.store is None or self._closed.is_set():
            return
        self._closed.set()
        try:
            self.store.set(_progress_key(self.rank), json.dumps({"seq": self._seq + 1, "phase": "done"}))
        except Exception:  # the store may be gone with a failed run; nothing left to tell
            pass

    # ------------------------------------------------------------------ the watching side

    def _watch(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        seen, changed = None, time.monotonic()
        try:
            while not self._closed.wait(POLL_S):
                self._tick()
                if self.store.check([_HANG_KEY]):
                    self._act(json.loads(self.store.get(_HANG_KEY)))
                    return
                value = self.store.get(_progress_key(neighbour)) if self.store.check([_progress_key(neighbour)]) \
                    else None
                now = time.monotonic()
                if value != seen:
                    seen, changed = value, now
                beat = json.loads(seen) if seen is not None else {"phase": "startup", "budget_s": self.first_budget_s}
                if beat["phase"] == "done" or now - changed <= beat["budget_s"]:
                    continue
                report = self._diagnose(neighbour, now - changed, beat["budget_s"])
                if self.store.get(_progress_key(neighbour)) != seen:
                    continue  # it made progress again while diagnosed: late, but not hung
                # The first diagnosis wins; every watcher then acts on the stored one.
                self.store.compare_set(_HANG_KEY, "", json.dumps(report))
        except Exception as e:  # the store is gone (the launcher or agent died): stop watching
            if not self._closed.is_set():
                print(f"moe-fold: rank {self.rank}: hang watch stopped: {type(e).__name__}: {e}", file=sys.stderr)

    def _tick(self) -> None:
        """This rank's watcher runs: its alive counter moves, and the newest beat not yet
        written goes to the store."""
        self._alive += 1
        self.store.set(_alive_key(self.rank), str(self._alive))
        with self._lock:
            if self._unwritten is not None:
                self._write_beat(time.monotonic())

    def _read(self, key: str) -> Optional[str]:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _diagnose(self, neighbour: int, silent_s: float, budget_s: float) -> dict:
        """Which ranks stalled: see the module docstring."""
        ranks = range(self.world_size)
        counters = [self._read(_alive_key(r)) for r in ranks]
        for _ in range(3):  # other watchers may be diagnosing too: this one keeps ticking
            time.sleep(POLL_S)
            self._tick()
        frozen = [r for r in ranks if r != self.rank and self._read(_alive_key(r)) in (None, counters[r])]
        beats = {r: json.loads(self._read(_progress_key(r)) or '{"seq": 0, "phase": "startup"}') for r in ranks}
        if frozen:
            stalled = frozen
        else:
            waiting = [r for r in ranks if beats[r]["phase"] != "done"]
            least = min(beats[r]["seq"] for r in waiting)
            stalled = [r for r in waiting if beats[r]["seq"] == least]
        return {"stalled": stalled, "frozen": bool(frozen), "live": [r for r in ranks if r not in frozen],
                "detected_by": self.rank, "neighbour": neighbour, "silent_s": round(silent_s, 1),
                "budget_s": budget_s, "beats": {str(r): b for r, b in beats.items()}, "time": time.time()}

    def _act(self, report: dict) -> None:
        """Write this rank's stacks (and, on the rank that diagnosed, the report), wait for
        the other live ranks' stacks, and end the process with HANG_EXIT_CODE."""
        first = report["stalled"][0]
        folder = self.run_dir / "hang" / f"step_{report['beats'][str(first)].get('step', 0):06d}"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"stacks_rank_{self.rank:05d}.txt", "w") as f:
            f.write(f"rank {self.rank}: last beat step {self._phase[0] if self._phase else 0} "
                    f"phase {self._phase[1] if self._phase else 'startup'}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        if report["detected_by"] == self.rank:
            text = describe(report, folder)
            (folder / "report.txt").write_text(text + "\n")
            (folder / "report.json").write_text(json.dumps(report, indent=1) + "\n")
            print(f"moe-fold: {text}", file=sys.stderr, flush=True)
        processes = {r: json.loads(self.store.get(_process_key(r))) for r in range(self.world_size)
                     if self.store.check([_process_key(r)])}
        for line in kill_stopped(report, processes, self.rank):
            print(f"moe-fold: hang: {line}", file=sys.stderr, flush=True)
        self.store.add(_DUMPED_KEY, 1)
        deadline = time.monotonic() + DUMP_WAIT_S
        while self.store.add(_DUMPED_KEY, 0) < len(report["live"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(HANG_EXIT_CODE)


def describe(report: dict, folder: Path) -> str:
    """The report's one paragraph: who stalled, where, and where the stacks are."""
    world = len(report["beats"])
    parts = []
    for r in report["stalled"]:
        b = report["beats"][str(r)]
        where = f"step {b['step']} ({b['phase']})" if "step" in b else "startup (no beat yet)"
        parts.append(f"rank {r} of {world} made no progress since {where}")
    why = ("it is not running (stopped, e.g. SIGSTOP, or frozen): it cannot write its own stacks"
           if report["frozen"] else "every rank is alive: see the stacks for where each one waits")
    live = ", ".join(map(str, report["live"]))
    return (f"hang: {'; '.join(parts)}; {why}. Seen by rank {report['detected_by']} after {report['silent_s']:g} s "
            f"without a beat from rank {report['neighbour']} (its budget {report['budget_s']:g} s, "
            f"train.hang_timeout_s). Python stacks of ranks {live}: {folder}/stacks_rank_*.txt; "
            f"exiting with code {HANG_EXIT_CODE} to be restarted from the newest checkpoint")


def read_report(run_dir: str | os.PathLike, since: float) -> Optional[str]:
    """The text of the newest hang report of ``run_dir`` written after ``since`` (a
    ``time.time()``), or None."""
    reports = [p for p in (Path(run_dir) / "hang").glob("step_*/report.txt") if p.stat().st_mtime >= since]
    return max(reports, key=lambda p: p.stat().st_mtime).read_text().strip() if reports else None
