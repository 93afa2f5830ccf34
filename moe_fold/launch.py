"""Run a function on N local ranks, one process each, joined by a gloo process group.

Used by the tests (every multi-rank test), the benchmarks and ``moe-fold train --nproc``.
Processes come from a forkserver that imported torch once, so a rank starts in a
fraction of a second and never inherits a parent's OpenMP threads or process groups.
The parent owns the TCP store (port chosen by the OS, so no port race): ranks connect
to it as clients.

Failure handling: a rank that raises sends its traceback to the parent, which kills
the other ranks (they would otherwise wait forever in a collective) and raises
:class:`RankError` with the first failing rank's traceback. A rank that dies without
a word (signal, ``os._exit``) and a run that exceeds ``timeout`` are reported the
same way; so is a rank that hangs (alive, silent) while its peers give up waiting for it
in a collective (the process group's timeout, ``MOE_FOLD_PG_TIMEOUT``). No process outlives :func:`run_ranks`.

Signals and orphans:

- ``forward_signals``: the first of them the parent receives (SIGTERM from a scheduler, Ctrl-C)
  is passed on to every rank and the parent goes on waiting for their results (the ranks
  stop at a step boundary: :mod:`moe_fold.training.stop`); a SIGINT after it kills the
  ranks and raises ``KeyboardInterrupt``. Each rank runs in its own process group, so a Ctrl-C
  in the terminal reaches the parent only and each rank gets it once, forwarded.
- A rank whose parent is gone (any death, SIGKILL included) exits at once: a thread waits
  on the parent's sentinel, a pipe only the parent holds open (:func:`exit_with_parent`).
  Without it a rank would train on, writing into the run folder, and keep the forkserver
  (which exits when every holder of its "alive" pipe, the ranks included, is gone) alive
  with it. torchrun's workers use the same watch on a pidfd of their agent
  (:func:`parent_handle`; ``moe_fold.cli.train``), there with a clean stop first.
- The forkserver starts with SIGTERM, SIGUSR1, SIGUSR2 and SIGHUP blocked (SIGINT it ignores
  itself): a signal sent to every process of the job (systemd's control group, a SLURM job
  step) must not end it, or the parent would take its ranks for dead while they stop.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.connection  # mp.connection.wait, for the parent watch
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

__all__ = ["RankError", "run_ranks", "keep_freed_memory", "exit_with_parent", "parent_handle", "agree_on_round"]

# torch.optim imports torch._dynamo on its first step (seconds); importing it once in the
# forkserver saves that in every rank.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
# Blocked in the forkserver (its ranks unblock them): see the module docstring.
_FORKSERVER_BLOCKS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory(device) -> bool:
    """On a CPU rank (``device``, a torch.device or its name, computes on the CPU), make
    this process's malloc keep freed memory for the next allocation instead of giving it
    back to the operating system. True if it took effect (glibc), else False.

    A GPU worker is left as it is: its activations live in GPU memory (torch's caching
    allocator already keeps those), and what its host heap holds (pinned checkpoint
    staging, data loading) should shrink back when freed, which this setting would stop
    for the rest of the process.

    By default glibc serves every allocation of 32 MiB or more (and smaller ones once its
    threshold adapts) with a fresh ``mmap`` and unmaps it on free, so a CPU training step
    that allocates the same activations and gradients every step faults in and zeroes
    every page of them again: 65,000 page faults and 140 ms of kernel time in a 420 ms
    MoE-layer step (bench/moe_layer.py, 4096x512x1024x8x2). With mmap off and the heap
    never trimmed, the pages stay mapped: no faults after the first step. The price is
    that the process keeps its peak heap, which a training loop reaches every step
    anyway.
    """
    if getattr(device, "type", str(device).split(":")[0]) != "cpu":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` failed; the message carries its traceback."""

    def __init__(self, rank: Optional[int], message: str):
        self.rank = rank
        super().__init__(message)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _context() -> mp.context.BaseContext:
    from multiprocessing import forkserver, resource_tracker

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    # Started first, alone: it blocks and then unblocks SIGTERM around its own start, which
    # would undo the block below.
    resource_tracker.ensure_running()
    # The signal mask survives fork and exec: the forkserver starts with these blocked. Here
    # they are only held back meanwhile, and delivered (to this process's handlers) after.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORKSERVER_BLOCKS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORKSERVER_BLOCKS)
    return ctx


# How long a rank told to stop because its parent is gone may take to finish its step and
# save it before it is ended anyway (it may be blocked in a collective with a dead peer).
PARENT_GONE_GRACE_S = 5.0


def parent_handle() -> Optional[int]:
    """A file descriptor that becomes readable once this process's parent is gone, whatever
    killed it: a pidfd of the parent (Linux 5.3+), None where the system has none (macOS).
    Take it early, before the parent can die: a parent already gone at this point yields a
    pidfd of the process this one was reparented to."""
    if not hasattr(os, "pidfd_open"):
        return None
    return os.pidfd_open(os.getppid())


def exit_with_parent(gone: int, who: str = "the process that started this rank",
                     stop_signal: Optional[int] = None, grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """End this process when its parent is gone: ``gone``, a file descriptor readable from
    then on (:func:`parent_handle`, or the sentinel of a multiprocessing child).

    Without ``stop_signal`` the process exits at once (``os._exit(1)``). With one, the watch
    first sends it to this process, so that a run stops after its current step with that
    step's checkpoint (:mod:`moe_fold.training.stop`), and exits ``grace_s`` later if it is
    still running: a rank blocked in a collective whose peer is gone must not hang.
    """

    def watch():
        mp.connection.wait([gone])
        if stop_signal is not None:
            with contextlib.suppress(OSError):  # stderr may have gone with the parent
                os.write(2, f"moe-fold: {who} is gone: stopping this rank ({signal.Signals(stop_signal).name}), "
                            f"ended in {grace_s:g} s if it is still running\n".encode())
            os.kill(os.getpid(), stop_signal)
            time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="moe-fold-parent-watch", daemon=True).start()


def agree_on_round(store, rank: int, world_size: int, timeout: datetime.timedelta, poll_s: float = 0.01) -> int:
    """A number every rank of this start gets, unlike any earlier start's on ``store``.

    torchrun's agent gives the workers of every restart the same TCP store, which still
    holds the keys of the starts before (the gloo addresses of ranks now dead): each start
    needs key prefixes of its own. TORCHELASTIC_RESTART_COUNT cannot name them: each agent
    counts its own restarts, so the agent of a node that comes back (an elastic grow) says
    0 where the others say 1. Instead rank 0 draws the next number from a counter, and
    gives it to each rank that asks with a nonce only that process knows: stale keys of
    earlier starts (old nonces, old numbers) are never mistaken for this start's.
    """
    import uuid

    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        number = store.add("moe-fold/round", 1)
        waiting = set(range(1, world_size))
        while waiting:
            for r in sorted(waiting):
                if store.check([f"moe-fold/round_{number}/ack/{r}"]):
                    waiting.discard(r)
                elif store.check([f"moe-fold/hello/{r}"]):
                    # Maybe an earlier start's nonce: answering it too is harmless.
                    store.set(f"moe-fold/reply/{store.get(f'moe-fold/hello/{r}').decode()}", str(number))
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(waiting)} did not join this start within {timeout}")
            time.sleep(poll_s if waiting else 0)
        return number
    nonce = uuid.uuid4().hex
    store.set(f"moe-fold/hello/{rank}", nonce)
    store.wait([f"moe-fold/reply/{nonce}"], timeout)
    number = int(store.get(f"moe-fold/reply/{nonce}"))
    store.set(f"moe-fold/round_{number}/ack/{rank}", "1")
    return number


def _rank_main(fn, rank, world_size, store_port, threads, env, forward_signals, args, kwargs, results):
    os.setpgid(0, 0)
    # The forkserver's blocked signals are unblocked, except those forwarded: they stay
    # blocked until the rank's code installs its handlers (training.stop.ExitSignals), so
    # one forwarded while the rank starts waits instead of killing it.
    signal.pthread_sigmask(signal.SIG_SETMASK, forward_signals)
    exit_with_parent(mp.parent_process().sentinel)

    import torch
    import torch.distributed as dist

    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=float(env.get("MOE_FOLD_PG_TIMEOUT", "120"))))
        try:
            # A rank whose side of gloo's connections is up may run a short fn and exit
            # while a slower peer still completes its handshake, which then fails with
            # "Connection closed by peer": no rank starts fn before every rank's is up.
            dist.barrier()
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor data into the message; the queue's own pickler would
        # pass shared-memory handles that die with this process before the parent reads.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt and SystemExit
        results.put((rank, False, traceback.format_exc()))


# Words in a traceback that mark a rank which failed only because a peer went away.
# "Application timeout caused pair closure" is how gloo reports a timed-out asynchronous
# collective at its wait (the overlap options post the dispatcher's all-to-alls so).
_PEER_FAILURE_MARKS = ("Connection closed by peer", "Connection reset by peer", "DistBackendError",
                       "Broken pipe", "timed out", "timeout caused pair closure")


def _root_failures(failures: dict[int, str]) -> list[int]:
    """The ranks whose traceback is their own error, not a peer's going away."""
    return [r for r, tb in sorted(failures.items()) if not any(m.lower() in tb.lower() for m in _PEER_FAILURE_MARKS)]


def _first_failure(procs, outputs, failures, world_size) -> RankError:
    died = [r for r, p in enumerate(procs)
            if r not in outputs and r not in failures and p.exitcode not in (None, 0)]
    if died:
        r = died[0]
        others = "".join(f"\n--- rank {o} then failed:\n{tb}" for o, tb in sorted(failures.items()))
        return RankError(r, f"rank {r} of {world_size} died with exit code {procs[r].exitcode} "
                            f"before returning a result{others}")
    root = _root_failures(failures)
    silent = [r for r, p in enumerate(procs) if r not in outputs and r not in failures and p.exitcode is None]
    if not root and silent:
        # Every failure is a peer's (a collective timed out or lost its connection) and
        # these ranks are alive but said nothing: hung, or stopped.
        r = silent[0]
        others = "".join(f"\n--- rank {o} failed:\n{tb}" for o, tb in sorted(failures.items()))
        return RankError(r, f"rank {r} of {world_size} stopped responding (alive, no result, no error) while "
                            f"rank{'s' if len(failures) > 1 else ''} {', '.join(map(str, sorted(failures)))} "
                            f"gave up waiting for it{others}")
    r = root[0] if root else min(failures)
    return RankError(r, f"rank {r} of {world_size} failed:\n{failures[r]}")


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    threads: int = 1,
    env: Optional[dict[str, str]] = None,
    forward_signals: Sequence[int] = (),
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    ``fn`` must be importable by name (a module-level function) and its return value
    picklable (tensors included: their data is copied). Returns the per-rank results, index = rank. Raises :class:`RankError`
    naming the first rank that failed, died or timed out.

    ``forward_signals`` (signal numbers): the first one this process receives goes to every
    rank, where it stays blocked until ``fn`` unblocks it (``training.stop.ExitSignals``
    does); a SIGINT after it kills the ranks and raises ``KeyboardInterrupt``. Handlers are
    installed only when called from the main thread.
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    child_env = {"MOE_FOLD_PG_TIMEOUT": str(int(timeout)), **(env or {})}
    procs: list = []
    received: list[int] = []

    def forward(signum, frame):
        if not received:
            received.append(signum)
            os.write(2, f"{signal.Signals(signum).name} received: passed on to the {world_size} ranks, which "
                        f"stop after their current step (Ctrl-C aborts at once)\n".encode())
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    # Installed before the forkserver starts: a signal that comes meanwhile is forwarded too.
    previous = {s: signal.signal(s, forward) for s in forward_signals} if _main_thread() else {}
    ctx = _context()
    results = ctx.Queue()
    procs.extend(
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, store.port, threads, child_env, tuple(forward_signals), args, kwargs,
                  results),
            daemon=True,
        )
        for rank in range(world_size)
    )
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout

    def receive(wait: float) -> bool:
        try:
            rank, ok, payload = results.get(timeout=wait)
        except queue.Empty:
            return False
        if ok:
            outputs[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
        return True

    try:
        for p in procs:
            p.start()
            if received:  # a signal that came before this rank existed
                os.kill(p.pid, received[0])
        while len(outputs) < world_size:
            # A rank that exits non-zero after its result came (its forkserver gone) has not failed.
            if failures or any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in outputs):
                # When one rank fails its peers soon fail too, inside a collective; wait
                # a moment so the report can name the rank that failed first. Not when a rank
                # failed of its own error (nothing later names an earlier one) or every rank
                # has ended (nothing more to hear): a restart (--max-restarts) waits on this.
                settle = time.monotonic() + 2.0
                while (time.monotonic() < settle and len(outputs) + len(failures) < world_size
                       and not _root_failures(failures)
                       and any(p.exitcode is None for r, p in enumerate(procs) if r not in outputs and r not in failures)):
                    receive(0.1)
                while receive(0.05):  # what ended ranks sent before they ended
                    pass
                raise _first_failure(procs, outputs, failures, world_size)
            if receive(0.2):
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise RankError(missing[0], f"timed out after {timeout:.0f}s waiting for ranks {missing}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        results.close()
        del store
    return [outputs[r] for r in range(world_size)]
