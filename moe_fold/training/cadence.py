"""When to save a checkpoint: every ``train.save_every`` steps, and by the clock.

Two clocks, one at a time (``validate`` refuses both):

- ``train.save_every_minutes``: a fixed time between saves;
- ``train.expected_mtbf_minutes``: the time that balances what a save costs against what a
  failure loses, from Young (1974) and Daly (2006): with a save that stalls training for
  ``stall`` seconds and failures every ``mtbf`` seconds on average, saving every
  ``sqrt(2 * stall * mtbf)`` seconds of training minimises the expected time lost (the
  stalls, plus half an interval of work redone per failure). ``stall`` is measured: the
  time the loop blocks in :meth:`CheckpointSaver.save` (for an asynchronous save, its
  host copy and the wait for the previous write), the median of the last
  :data:`STALLS_KEPT` saves, so the interval is re-estimated at every save. Until one is
  measured there is no interval: the run saves after its first step to measure it.

Either clock adds to the step rule, never replaces it: a step is saved when
``step % save_every == 0`` or when the interval has passed since the end of the last save
(or since the start), whichever comes first (and at the last step, and on a stop, as
before). A run that should save by time alone sets ``save_every`` beyond ``steps``.

The ranks must save at the same step, but their clocks and stalls differ: with a clock on,
a save is due on every rank once it is due on one. The cadence is a
:class:`~moe_fold.training.stop.StepVote` of the loop's stop check, whose all-reduce after
each step carries this rank's answer too (:meth:`Cadence.vote`, :meth:`Cadence.agreed`);
:meth:`Cadence.due` then reads the agreed answer, and only for a step the stop check did
not see is it a collective of its own (a max all-reduce of one flag over the world).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe_fold.comm import all_reduce_
from moe_fold.config import Config

__all__ = ["start_cadence", "STALLS_KEPT", "Cadence", "young_daly_interval"]

STALLS_KEPT = 5  # the median of the last few stalls: the first async save also allocates its host buffer


def young_daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Seconds of training between saves that stall ``stall_s`` each, with failures every
    ``mtbf_s`` seconds on average: ``sqrt(2 * stall_s * mtbf_s)`` (Young's first-order
    optimum; Daly's refinements matter only when the stall nears the MTBF)."""
    if not stall_s >= 0 or not mtbf_s > 0:
        raise ValueError(f"stall_s={stall_s!r} must be >= 0 and mtbf_s={mtbf_s!r} > 0")
    return math.sqrt(2.0 * stall_s * mtbf_s)


class Cadence:
    """Decides after each step whether it is saved (see the module docstring).
    ``clock``: seconds, monotonic (a test passes a fake one)."""

    def __init__(self, config: Config, device: torch.device, world_size: int,
                 clock: Callable[[], float] = time.monotonic):
        t = config.train
        self.every_steps = t.save_every
        self.fixed_s = None if t.save_every_minutes is None else 60.0 * t.save_every_minutes
        self.mtbf_s = None if t.expected_mtbf_minutes is None else 60.0 * t.expected_mtbf_minutes
        self.device, self.world_size, self.clock = device, world_size, clock
        self.stalls: deque[float] = deque(maxlen=STALLS_KEPT)
        self.last_save = clock()
        self._agreed: Optional[tuple[int, bool]] = None  # (step, the world's answer) from the stop check

    @property
    def timed(self) -> bool:
        """Whether a clock adds saves to the step rule."""
        return self.fixed_s is not None or self.mtbf_s is not None

    @property
    def interval_s(self) -> Optional[float]:
        """The time between saves in use, in seconds; None: none (steps only, or no stall measured yet)."""
        if self.fixed_s is not None:
            return self.fixed_s
        if self.mtbf_s is not None and self.stalls:
            return young_daly_interval(statistics.median(self.stalls), self.mtbf_s)
        return None

    def due_here(self, step: int) -> bool:
        """Whether this rank's rules save ``step`` (no collective)."""
        if step % self.every_steps == 0:
            return True
        if self.mtbf_s is not None and not self.stalls:
            return True  # no stall measured yet: save to measure one
        interval = self.interval_s
        return interval is not None and self.clock() - self.last_save >= interval

    def vote(self, step: int) -> bool:
        """This rank's answer for ``step``, for the stop check's all-reduce (StepVote)."""
        return self.due_here(step)

    def agreed(self, step: int, answer: bool) -> None:
        """The world's answer for ``step`` (StepVote), which :meth:`due` returns."""
        self._agreed = (step, answer)

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved, the same answer on every rank: the one agreed in the
        stop check after ``step`` (:meth:`agreed`), else, when :attr:`timed`, a collective
        (every rank must then call it after every step)."""
        agreed, self._agreed = self._agreed, None  # read once: a step run again after a rollback votes again
        if agreed is not None and agreed[0] == step:
            return agreed[1]
        due = self.due_here(step)
        if self.timed and self.world_size > 1:
            flag = torch.full((1,), int(due), dtype=torch.int64, device=self.device)
            all_reduce_(flag, dist.group.WORLD, op="max")
            due = bool(flag.item())  # one read per step, only with a clock on
        return due

    def saved(self, stall_s: float) -> None:
        """A save just returned after blocking the loop ``stall_s`` seconds."""
        self.stalls.append(stall_s)
        self.last_save = self.clock()

    def describe(self) -> str:
        """The rule in use, for the start of the run and the log."""
        steps = f"every {self.every_steps} steps"
        if self.fixed_s is not None:
            return f"checkpoints {steps} or every {self.fixed_s / 60:g} min (train.save_every_minutes), whichever first"
        if self.mtbf_s is not None:
            interval = self.interval_s
            now = ("not known yet: the first step is saved to measure the stall" if interval is None else
                   f"{interval:.1f} s from a stall of {statistics.median(self.stalls):.3f} s")
            return (f"checkpoints {steps} or every sqrt(2 x save stall x {self.mtbf_s / 60:g} min "
                    f"(train.expected_mtbf_minutes)), whichever first; interval {now}")
        return f"checkpoints {steps}"


def start_cadence(config: Config, device: torch.device, world_size: int, logger, start_step: int) -> Cadence:
    """The run's cadence; with a clock on, the rule in use is printed and logged
    (``{"step", "event": "save_interval", "save_interval_s"}`` in metrics.jsonl)."""
    cadence = Cadence(config, device, world_size)
    if cadence.timed:
        logger.log_event({"step": start_step, "event": "save_interval", "save_interval_s": cadence.interval_s},
                         cadence.describe())
    return cadence
