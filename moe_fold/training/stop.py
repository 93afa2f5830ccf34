"""Stopping a run before ``train.steps``, every rank after the same step, with that step's checkpoint.

Three things end a run early:

- a signal of ``train.exit_signals`` (default SIGTERM, SIGINT, SIGUSR1: what SLURM,
  Kubernetes and systemd send before they kill, and Ctrl-C), received by any rank. The
  handler only notes it (:class:`ExitSignals`); the loop acts at the next step boundary;
- ``train.exit_after_minutes``: the wall clock since :func:`moe_fold.training.train.train`
  started, checked after each step (so a run always makes at least one step);
- ``train.exit_at_step``: the run ends after that step (at once when a resumed run is
  already there).

The ranks agree (:meth:`StopRule.check`, a collective): after each step one all-reduce
(max) of two numbers over the world, the signal a rank received and whether its clock
passed the budget. A signal that reached one rank only, or clocks that differ by a step,
still stop every rank after the same step; that step's checkpoint is then written by all.
Other decisions every rank must take alike after a step ride in the same all-reduce
(:class:`StepVote`: the checkpoint clock of :mod:`moe_fold.training.cadence`), so a step
has one such collective and one read of its result, not one per decision.

A second Ctrl-C aborts at once: once a signal is noted, SIGINT has its default action again
(the process ends; a shell reports exit code 130), without a checkpoint of the step.

Exit codes of ``moe-fold train`` (:attr:`Stop.exit_code`): 0 when the run reached
``train.steps`` or stopped at a budget (a budget stop is an end the user asked for, and
torchrun would restart a group whose worker exits non-zero); 128 + the signal number
after a signal stop (SIGTERM 143, SIGINT 130, SIGUSR1 138), the convention of shells and
schedulers for "ended by that signal"; 1 for a failure and 2 for a bad config, as before.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from moe_fold.comm import all_reduce_
from moe_fold.config import Config

__all__ = ["ExitSignals", "Stop", "StopRule", "StepVote"]


@dataclass(frozen=True)
class Stop:
    """Why and where a run stopped early."""

    step: int  # the last step run; its checkpoint is written (0 or the resumed step: none run)
    reason: str  # "SIGTERM received", "train.exit_at_step=40 reached", ...
    exit_code: int

    def message(self, steps: int, checkpoint: Optional[str], ran: bool) -> str:
        """The one line ``moe-fold train`` ends with."""
        if not ran:
            return f"stopped before step {self.step + 1} of {steps}: {self.reason}; no step run, nothing saved"
        return (f"stopped after step {self.step} of {steps}: {self.reason}; checkpoint {checkpoint}; "
                f"continue with --resume")


class ExitSignals:
    """While the ``with`` block runs, notes the first of ``names`` this process receives
    (:attr:`received`, a signal number; 0: none) instead of letting it end the process.

    Python installs handlers only in the main thread; in another thread it notes nothing
    and the signals keep their handlers. On entry the signals are also unblocked:
    :func:`moe_fold.launch.run_ranks` blocks the ones it forwards while a rank starts, so
    that one sent before the handlers exist waits here instead of being lost."""

    def __init__(self, names: list[str]):
        self.signals = [signal.Signals[name] for name in names]
        self.received = 0
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> "ExitSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in self.signals}
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def _note(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum
        if signal.SIGINT in self._previous:
            # A Ctrl-C from now on: the default action, at once, even inside a long C call.
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class StepVote(Protocol):
    """A yes/no decision after a step that every rank must take alike, agreed in
    :meth:`StopRule.check`'s all-reduce: :meth:`vote` gives this rank's answer, then
    :meth:`agreed` hears the world's (yes when any rank said yes)."""

    def vote(self, step: int) -> bool: ...

    def agreed(self, step: int, answer: bool) -> None: ...


class StopRule:
    """Decides after each step whether the run stops there (see the module docstring);
    ``votes`` ride in the same all-reduce (:class:`StepVote`)."""

    def __init__(self, config: Config, signals: ExitSignals, device: torch.device, world_size: int,
                 began: float, votes: Sequence[StepVote] = ()):
        self.steps = config.train.steps
        self.minutes = config.train.exit_after_minutes
        self.at_step = config.train.exit_at_step
        self.signals = signals
        self.device = device
        self.world_size = world_size
        self.began = began  # time.monotonic() when the run started
        self.votes = list(votes)

    def check(self, step: int, after_a_step: bool = True) -> Optional[Stop]:
        """A collective: every rank calls it after each step (and once before the first,
        with ``after_a_step=False``, where the time budget does not count); the same
        answer on every rank. None after the last step of ``train.steps``: the run is
        complete whatever arrived during it."""
        timed_out = (after_a_step and self.minutes is not None
                     and time.monotonic() - self.began >= 60.0 * self.minutes)
        signum, timed_out = self.signals.received, int(timed_out)
        votes = [int(v.vote(step)) for v in self.votes]
        if self.world_size > 1:
            # Filled on the device (a list copied from the host would block it), read once.
            flags = torch.zeros(2 + len(votes), dtype=torch.int64, device=self.device)
            flags[0], flags[1] = signum, timed_out
            for i, answer in enumerate(votes):
                flags[2 + i] = answer
            all_reduce_(flags, dist.group.WORLD, op="max")
            signum, timed_out, *votes = flags.tolist()
        for voter, answer in zip(self.votes, votes):
            voter.agreed(step, bool(answer))
        if step >= self.steps:  # the run is complete: nothing to stop
            return None
        if signum:
            return Stop(step, f"{signal.Signals(signum).name} received", 128 + signum)
        if timed_out:
            return Stop(step, f"train.exit_after_minutes={self.minutes:g} reached", 0)
        if self.at_step is not None and step >= self.at_step:
            return Stop(step, f"train.exit_at_step={self.at_step} reached", 0)
        return None
