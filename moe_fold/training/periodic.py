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
from typing import Any, Callable, Optional

from moe_fold.training.numerics import LossSpikes
from moe_fold.training.stop import Stop, StopRule

__all__ = ["StepRecord", "Action", "ReplaceExperts", "WatchLossSpikes", "LogStep", "RollBack", "Evaluate",
           "CheckStop", "SaveCheckpoint", "at_step", "stopping"]


@dataclass
class StepRecord:
    """One optimizer step: what the step measured, then what the periodic actions added."""
    step: int
    loss: float  # lm_loss plus the routers' and MTP's weighted losses
    lm_loss: float  # the global batch's mean LM loss
    grad_norm: float  # the global gradient norm before clipping (NaN when the loss was not finite)
    lr: float  # the rate this step used
    skipped: bool  # a non-finite loss or gradient norm: no optimizer step was taken
    nonfinite_module: Optional[str]  # on a skipped step: the first module whose output went non-finite
    routing: dict  # the routing collector's fields (RoutingCollector.finish_step) and the re-placement's
    mtp: dict  # the MTP collector's fields (MTPCollector.finish_step)
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
                "loss_spike": self.loss_spike, **nonfinite, **self.routing, **self.mtp, **self.extra}


Action = Callable[[StepRecord], None]


def _no_beat(step: int, phase: str) -> None:
    """No hang detection (:class:`moe_fold.training.heartbeat.Heartbeat` ``.beat`` otherwise):
    the actions that may take longer than a step say so as they begin."""


class ReplaceExperts:
    """``moe.replace_every``: the replacer adds the step's expert load to its window and,
    on a re-placement step, moves the experts; what moved joins the step's routing fields."""

    def __init__(self, replacer: Any, optimizer: Any, beat: Callable[[int, str], None] = _no_beat):
        self.replacer = replacer  # moe_fold.training.replace.ExpertReplacer; None: nothing to do
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

    def __init__(self, spikes: LossSpikes, warn: bool, stop: bool = False):
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
    is logged, the last checkpoint is loaded again (``load``) and the batches that caused it
    are skipped for good (:class:`moe_fold.training.rollback.Rollbacks`); the step to go on
    from goes on the record (``rolled_back_to``) and the loop undoes the steps after it. A
    collective when it rolls back: the loss and grad norm it judges are global."""

    def __init__(self, rollbacks: Any, saver: Any, load: Callable[[Any], dict], logger: Any):
        self.rollbacks, self.saver, self.load, self.logger = rollbacks, saver, load, logger

    def __call__(self, record: StepRecord) -> None:
        why = self.rollbacks.reason(not record.skipped, record.loss_spike)
        if why is not None:
            record.rolled_back_to = self.rollbacks.roll_back(record.step, why, self.saver, self.load, self.logger)


class LogStep:
    """The step's row: metrics.jsonl, wandb and the console (:class:`MetricsLogger`)."""

    def __init__(self, logger: Any, collector: Any, tokens_per_step: int):
        self.logger = logger  # moe_fold.training.metrics.MetricsLogger
        self.collector = collector  # its per-layer routing metrics and heatmaps
        self.tokens_per_step = tokens_per_step

    def __call__(self, record: StepRecord) -> None:
        record.seconds = time.perf_counter() - record.began
        self.logger.log(record.row(self.tokens_per_step), self.collector)


class Evaluate:
    """``train.eval_every``: every ``every`` steps (0: never) and at ``final_step`` (``train.steps``),
    ``evaluate()`` (the validation loss: its own loader and a forked RNG, so training is
    unchanged) goes to its own row. A collective: every rank runs it at the same steps."""

    def __init__(self, every: int, final_step: int, evaluate: Callable[[], dict], logger: Any,
                 beat: Callable[[int, str], None] = _no_beat):
        self.every, self.final_step = every, final_step
        self.evaluate = evaluate
        self.logger = logger
        self.beat = beat

    def __call__(self, record: StepRecord) -> None:
        if self.every > 0 and (record.step % self.every == 0 or record.step == self.final_step):
            self.beat(record.step, "eval")
            self.logger.log_eval({"step": record.step, **self.evaluate()})


class CheckStop:
    """Whether the run stops after this step (:class:`moe_fold.training.stop.StopRule`, a
    collective: the same answer on every rank); said on ``console`` (rank 0's, or None)."""

    def __init__(self, stops: StopRule, console: Any):
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
    """After a step where any of ``when`` is true: the checkpoint of the step (weights,
    optimizer, schedule, data position, expert placement, and ``extra_state()``) through
    ``saver`` (a :class:`moe_fold.training.checkpoint.CheckpointSaver`, in the background
    with ``train.async_save``); its path goes on the record, and ``on_saved(step, stall_s)``
    hears how long the save blocked the loop. ``run``: the
    :class:`moe_fold.training.run_setup.Run` whose state is saved."""

    def __init__(self, run: Any, saver: Any, when: list[Callable[[StepRecord], bool]],
                 extra_state: Callable[[], dict] = dict, on_saved: Callable[[int, float], None] = lambda s, t: None,
                 beat: Callable[[int, str], None] = _no_beat):
        self.run = run
        self.saver = saver
        self.when = when
        self.extra_state, self.on_saved, self.beat = extra_state, on_saved, beat

    def __call__(self, record: StepRecord) -> None:
        # Every predicate is asked, in order (no short cut: a clock's may be a collective).
        if not any([due(record) for due in self.when]):
            return
        self.beat(record.step, "save")
        run = self.run
        run.optimizer.wait_params()  # the checkpoint reads the parameters
        extra = {"step": record.step, "data": run.loader.state_dict(), **self.extra_state()}
        if run.replacer is not None:
            extra["experts"] = run.replacer.state_dict()
        began = time.perf_counter()
        record.checkpoint = str(self.saver.save(record.step, run.state_model, run.optimizer, run.scheduler, extra))
        self.on_saved(record.step, time.perf_counter() - began)
