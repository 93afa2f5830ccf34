"""What the training loop does after each step, in order: the periodic actions.

The step (:func:`moe_fold.training.train.run_step`) returns a :class:`StepRecord`; the
loop then calls each action of its ordered list on that record. An action is any
``Callable[[StepRecord], None]``: it does its work when due and writes what it found or
did onto the record, which later actions read (a re-placement's fields join the logged
row, a stop makes the save due, the save notes its checkpoint). The record is the only
state they share, so each action is built from its own collaborators and tested alone.

The loop's list (:func:`moe_fold.training.train._train`)::

    ReplaceExperts   moe.replace_every: re-place the experts from the window's load
    WatchLossSpikes  train.loss_spike_factor: flag (and warn of) a loss spike
    LogStep          the step's row of metrics.jsonl, wandb, the console
    RollBack         train.on_nonfinite / on_loss_spike=rollback: undo a bad step
    Evaluate         train.eval_every: the validation loss
    CheckStop        a signal, train.exit_after_minutes, train.exit_at_step
    SaveCheckpoint   train.save_every (and the clock: moe_fold.training.cadence), the last
                     step, and a stop

Adding an action is one line in that list, at the place its order asks for: before
``LogStep`` to put a field in the step's row, before ``SaveCheckpoint`` to change what is
saved, after it to see the checkpoint. A new reason to save is one more predicate in
``SaveCheckpoint``'s ``when``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from moe_fold.training.numerics import LossSpikes
from moe_fold.training.stop import Stop, StopRule

if TYPE_CHECKING:
    from rich.console import Console

    from moe_fold.training.cadence import Cadence
    from moe_fold.training.checkpoint import CheckpointSaver
    from moe_fold.training.metrics import MetricsLogger, RoutingCollector
    from moe_fold.training.optim import AdamW
    from moe_fold.training.replace import ExpertReplacer
    from moe_fold.training.rollback import Rollbacks
    from moe_fold.training.run_setup import Run

__all__ = ["StepRecord", "Action", "ReplaceExperts", "WatchLossSpikes", "LogStep", "RollBack", "Evaluate",
           "CheckStop", "SaveCheckpoint", "at_step", "stopping"]


@dataclass
class StepRecord:
    """One optimizer step: what the step measured, then what the periodic actions added."""
    step: int
    loss: float  # lm_loss plus the routers' and MTP's weighted losses (the step computes it)
    lm_loss: float  # the global batch's mean LM loss
    grad_norm: float  # the global gradient norm before clipping (NaN when the loss was not finite)
    lr: float  # the rate this step used
    skipped: bool  # a non-finite loss or gradient norm: no optimizer step was taken
    nonfinite_module: Optional[str]  # on a skipped step: the first module whose output went non-finite
    losses: dict  # the step's loss fields: aux_loss, z_loss, mtp_loss (StepLossValues.fields)
    routing: dict  # the routing collector's fields (RoutingCollector.read) and the re-placement's
    began: float  # time.perf_counter() when the step began
    # Written by the actions:
    loss_spike: bool = False  # WatchLossSpikes
    seconds: Optional[float] = None  # LogStep: the step's wall time, re-placement included
    stop: Optional[Stop] = None  # CheckStop: the run stops after this step
    checkpoint: Optional[str] = None  # SaveCheckpoint: the checkpoint written after this step
    rolled_back_to: Optional[int] = None  # RollBack: the step undone, the run goes on after this one
    extra: dict = field(default_factory=dict)  # an action's own fields for the step's row

    def row(self, tokens_per_step: int) -> dict:
        """The step's line of metrics.jsonl (``seconds`` set)."""
        nonfinite = {"nonfinite_module": self.nonfinite_module} if self.skipped else {}
        return {"step": self.step, "loss": self.loss, "lm_loss": self.lm_loss, "grad_norm": self.grad_norm,
                "lr": self.lr, "tokens_per_s": tokens_per_step / self.seconds, "skipped": self.skipped,
                "loss_spike": self.loss_spike, **nonfinite, **self.losses, **self.routing, **self.extra}


Action = Callable[[StepRecord], None]


def _no_beat(step: int, phase: str) -> None:
    """No hang detection (:class:`moe_fold.training.heartbeat.Heartbeat` ``.beat`` otherwise):
    the actions that may take longer than a step say so as they begin."""


class ReplaceExperts:
    """``moe.replace_every``: the replacer adds the step's expert load to its window and,
    on a re-placement step, moves the experts; what moved joins the step's routing fields."""

    def __init__(self, *, replacer: Optional[ExpertReplacer], optimizer: AdamW,
                 beat: Callable[[int, str], None] = _no_beat):
        self.replacer = replacer  # None: nothing to do
        self.optimizer = optimizer
        self.beat = beat  # hang detection: a re-placement is a phase of its own

    def __call__(self, record: StepRecord) -> None:
        if self.replacer is None:
            return
        self.optimizer.wait_params()  # the replacer moves expert weights
        if self.replacer.every and record.step % self.replacer.every == 0:  # a re-placement step
            self.beat(record.step, "replace")
        record.routing.update(self.replacer.after_step(record.step, record.routing["expert_load"]))


class WatchLossSpikes:
    """A loss above ``train.loss_spike_factor`` x the median of the previous
    ``train.loss_spike_window`` losses (``spikes``, the run's window): ``loss_spike`` on the
    record, and a warning where ``warn`` (rank 0); ``stop`` (``train.on_loss_spike=stop``):
    raise before the step is saved."""

    def __init__(self, *, spikes: LossSpikes, warn: bool, stop: bool = False):
        self.spikes = spikes
        self.warn, self.stop = warn, stop

    def __call__(self, record: StepRecord) -> None:
        median = self.spikes.median()
        record.loss_spike = self.spikes.check(record.loss)
        if not record.loss_spike:
            return
        problem = (f"step {record.step}: loss spike: {record.loss:.6g} > train.loss_spike_factor="
                   f"{self.spikes.factor} x {median:.6g}, the median of the previous {self.spikes.history.maxlen} losses")
        if self.stop:
            raise FloatingPointError(f"{problem}; stopping (train.on_loss_spike=stop)")
        if self.warn:
            warnings.warn(problem, stacklevel=2)


class RollBack:
    """``train.on_nonfinite=rollback``, ``train.on_loss_spike=rollback``: after a bad step
    is logged, the last checkpoint is loaded into ``run`` again
    (:func:`moe_fold.training.run_setup.load_state`) and the batches that caused it are
    skipped for good (``run.rollbacks``, :class:`moe_fold.training.rollback.Rollbacks`); the
    step to go on from goes on the record (``rolled_back_to``) and the loop undoes the steps
    after it. A collective when it rolls back: the loss and grad norm it judges are global."""

    def __init__(self, *, run: Run, saver: CheckpointSaver, logger: MetricsLogger):
        self.run, self.saver, self.logger = run, saver, logger

    def __call__(self, record: StepRecord) -> None:
        from moe_fold.training.run_setup import load_state

        rollbacks = self.run.rollbacks
        why = rollbacks.reason(not record.skipped, record.loss_spike)
        if why is not None:
            record.rolled_back_to = rollbacks.roll_back(record.step, why, self.saver,
                                                        lambda path: load_state(self.run, path), self.logger)


class LogStep:
    """The step's row: metrics.jsonl, wandb and the console (:class:`MetricsLogger`)."""

    def __init__(self, *, logger: MetricsLogger, collector: Optional[RoutingCollector], tokens_per_step: int):
        self.logger = logger
        self.collector = collector  # its per-layer routing metrics and heatmaps (None: no routing metrics)
        self.tokens_per_step = tokens_per_step

    def __call__(self, record: StepRecord) -> None:
        record.seconds = time.perf_counter() - record.began
        self.logger.log(record.row(self.tokens_per_step), self.collector)


class Evaluate:
    """``train.eval_every``: every that many steps (0: never) and at ``train.steps``, the
    validation loss of ``run``'s model (:meth:`Run.validation_loss`: its own loader and a
    forked RNG, so training is unchanged) goes to its own row. A collective: every rank
    runs it at the same steps."""

    def __init__(self, *, run: Run, logger: MetricsLogger, beat: Callable[[int, str], None] = _no_beat):
        self.run = run
        self.every, self.final_step = run.config.train.eval_every, run.config.train.steps
        self.logger = logger
        self.beat = beat

    def __call__(self, record: StepRecord) -> None:
        if self.every > 0 and (record.step % self.every == 0 or record.step == self.final_step):
            self.beat(record.step, "eval")
            self.logger.log_eval({"step": record.step, **self.run.validation_loss()})


class CheckStop:
    """Whether the run stops after this step (:class:`moe_fold.training.stop.StopRule`, a
    collective: the same answer on every rank); said on ``console`` (rank 0's, or None)."""

    def __init__(self, *, stops: StopRule, console: Optional[Console]):
        self.stops = stops
        self.console = console

    def __call__(self, record: StepRecord) -> None:
        record.stop = self.stops.check(record.step)
        if record.stop is not None and self.console is not None:
            self.console.print(f"stopping after step {record.step}: {record.stop.reason}; writing its checkpoint")


def at_step(last: int) -> Callable[[StepRecord], bool]:
    """Due at step ``last`` (the last step this run takes)."""
    return lambda record: record.step == last


def stopping(record: StepRecord) -> bool:
    """Due when the run stops after this step (a checkpoint to resume from)."""
    return record.stop is not None


class SaveCheckpoint:
    """After a step where ``cadence`` (:class:`moe_fold.training.cadence.Cadence`: every
    ``train.save_every`` steps, or its clock) or any of ``when`` is due: the checkpoint of
    ``run``'s step (weights, optimizer, schedule, data position, expert placement, and the
    rollback state) through ``saver`` (a :class:`moe_fold.training.checkpoint.CheckpointSaver`,
    in the background with ``train.async_save``); its path goes on the record. Then the
    cadence hears how long the save blocked the loop (logged with the stall when a clock is
    on; its interval printed when first known) and the checkpoint becomes the one a
    rollback returns to."""

    def __init__(self, *, run: Run, saver: CheckpointSaver, cadence: Cadence, logger: MetricsLogger,
                 when: list[Callable[[StepRecord], bool]], beat: Callable[[int, str], None] = _no_beat):
        self.run = run
        self.saver = saver
        self.cadence, self.logger = cadence, logger
        self.when = when
        self.beat = beat

    def __call__(self, record: StepRecord) -> None:
        # Every predicate is asked, in order (no short cut: the clock's is a collective).
        if not any([self.cadence.due(record.step)] + [due(record) for due in self.when]):
            return
        self.beat(record.step, "save")
        run = self.run
        run.optimizer.wait_params()  # the checkpoint reads the parameters
        extra = {"step": record.step, "data": run.loader.state_dict(), **run.rollbacks.state_dict()}
        if run.replacer is not None:
            extra["experts"] = run.replacer.state_dict()
        began = time.perf_counter()
        record.checkpoint = str(self.saver.save(record.step, run.state_model, run.optimizer, run.scheduler, extra))
        self._saved(record.step, time.perf_counter() - began)

    def _saved(self, step: int, stall_s: float) -> None:
        cadence = self.cadence
        known = cadence.interval_s is not None
        cadence.saved(stall_s)
        self.run.rollbacks.saved(step)
        if cadence.timed:
            self.logger.log_event({"step": step, "event": "save_interval", "save_stall_s": stall_s,
                                   "save_interval_s": cadence.interval_s}, None if known else cadence.describe())
