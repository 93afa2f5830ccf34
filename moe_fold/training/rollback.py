"""Rolling back a bad step: the last checkpoint loaded again, the batches that caused it skipped for good.

``train.on_nonfinite=rollback`` (a non-finite global loss or grad norm) and
``train.on_loss_spike=rollback`` (a loss above ``train.loss_spike_factor`` x the median of
the window, :class:`moe_fold.training.numerics.LossSpikes`) do the same after the bad
step ``b`` has been logged:

1. wait until the save in flight (if any) is complete on every rank;
2. the global batches of the last ``train.rollback_skip_batches`` steps up to ``b`` (never
   further back than the step after the checkpoint) join the loader's skip set
   (:attr:`moe_fold.data.loader.DataLoader.skip`) and, by rank 0, ``<run_dir>/skipped_batches.json``;
3. the newest checkpoint this run saved (or resumed from), step ``s < b``, is loaded again
   by the loop's own loader of checkpoints: model, optimizer moments and step count,
   scheduler, random states, data position, expert placement, and the loss-spike window;
4. a row ``{"step": b, "event": "rollback", "to_step": s, ...}`` goes to metrics.jsonl, and
   the loop goes on with step ``s + 1``, on the next global batch not skipped.

The steps after ``s`` are then those of a run that never saw the skipped batches:
``train.skip_batches`` lists global batches to skip from the start, which is how the tests
build that reference run (tests/training/test_rollback.py).

Why from disk, not from the asynchronous saver's host copy: that copy holds only the
pieces this rank *writes* (one replica of each element over the whole world: a dp replica
keeps none of its weights), it is overwritten by the next save while being written, and a
synchronous save has none. Reading the checkpoint back needs no memory beyond training,
goes through the one loader that every resume uses (each file checked against its
sha256), and costs a checkpoint read per rollback, a rare event.

A skipped batch is recorded so that a resume skips it too: ``skipped_batches.json`` is
written before the checkpoint is loaded again (a crash after it still knows the batch),
and every later checkpoint's extra state carries ``skipped_batches``. A resumed run
skips the union of both; a fresh run (no ``--resume``) removes the file.

Limits: before the run's first checkpoint there is no good state to return to; the batches
are recorded and the run stops with :class:`RollbackError` (``--resume``, or a torchrun
restart, then starts again from step 0 without them). More than ``train.max_rollbacks``
rollbacks to the same checkpoint (a fault that skipping batches does not cure) stop the run
with :class:`RollbackError` as well.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

from moe_fold.config import Config
from moe_fold.layout import ProcessGroups
from moe_fold.training.numerics import LossSpikes

__all__ = ["SKIP_FILE", "RollbackError", "Rollbacks", "read_skipped_batches"]

SKIP_FILE = "skipped_batches.json"


class RollbackError(RuntimeError):
    """A rollback that cannot happen (no checkpoint yet, or too many to one checkpoint)."""


def read_skipped_batches(run_dir: str | os.PathLike) -> tuple[list[int], list[dict]]:
    """The global batches and the rollbacks recorded in ``<run_dir>/skipped_batches.json``
    (empty without the file)."""
    path = Path(run_dir) / SKIP_FILE
    if not path.is_file():
        return [], []
    try:
        record = json.loads(path.read_text())
        return [int(b) for b in record["skipped_batches"]], list(record["rollbacks"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RollbackError(f"cannot read {path}: {err}") from err


class Rollbacks:
    """The rollback policy of one run and what it has skipped (see the module docstring).

    ``loader``: the run's DataLoader (its ``skip`` set is filled here); ``spikes``: the
    run's loss-spike window (saved in checkpoints, restored by a rollback or a resume).
    ``resume``: a resumed run keeps ``skipped_batches.json``; a fresh one removes it."""

    def __init__(self, config: Config, groups: ProcessGroups, loader, spikes: LossSpikes, resume: bool):
        t = config.train
        self.on_nonfinite, self.on_loss_spike = t.on_nonfinite, t.on_loss_spike
        self.skip_count, self.limit = t.rollback_skip_batches, t.max_rollbacks
        self.groups, self.loader, self.spikes = groups, loader, spikes
        self.path = Path(t.run_dir) / SKIP_FILE
        batches, self.history = read_skipped_batches(t.run_dir) if resume else ([], [])  # history: the file's rollbacks
        self.recorded: set[int] = set(batches)
        if not resume and groups.rank == 0 and self.path.exists():
            self.path.unlink()
        loader.skip |= set(t.skip_batches) | self.recorded
        self.good_step: Optional[int] = None  # the newest checkpoint of this run
        self.good_position = loader.consumed_samples  # the data position there (fresh: the start)
        self.counts: dict[Optional[int], int] = {}  # rollbacks to each checkpoint step

    # --------------------------------------------------------------- checkpoint state

    def state_dict(self) -> dict:
        """What a checkpoint's extra state keeps: the batches skipped so far, the spike window."""
        return {"skipped_batches": sorted(self.recorded), "loss_window": list(self.spikes.history)}

    def load_state_dict(self, extra: dict) -> None:
        """After a checkpoint of step ``extra["step"]`` is loaded (a resume or a rollback)."""
        self.recorded |= {int(b) for b in extra.get("skipped_batches", [])}
        self.loader.skip |= self.recorded
        self.spikes.history.clear()
        self.spikes.history.extend(extra.get("loss_window", []))
        self.saved(int(extra["step"]))

    def saved(self, step: int) -> None:
        """The checkpoint of ``step`` was saved (the data position is the loader's now)."""
        self.good_step, self.good_position = step, self.loader.consumed_samples

    # --------------------------------------------------------------- the decision

    def reason(self, finite: bool, spike: bool) -> Optional[str]:
        """Why the step just run must be rolled back, None when it stands. The same on
        every rank: the loss and the grad norm it is judged on are global."""
        if not finite and self.on_nonfinite == "rollback":
            return "non-finite loss or gradient norm (train.on_nonfinite=rollback)"
        if finite and spike and self.on_loss_spike == "rollback":
            return "loss spike (train.on_loss_spike=rollback)"
        return None

    def roll_back(self, step: int, reason: str, saver, load: Callable[[Path], dict], logger) -> int:
        """Undo the steps after the last checkpoint up to ``step`` (a collective: every
        rank calls it after the same step) and return the checkpoint's step; see the
        module docstring. ``load(path)`` loads a checkpoint into the run (the loop's
        resume path) and returns its extra state."""
        from moe_fold.training.checkpoint import checkpoint_path

        began = time.perf_counter()
        saver.wait(collective=True)
        gbs = self.loader.global_batch_size
        run = [g for g in range(self.good_position // gbs, self.loader.last_batch + 1) if g not in self.loader.skip]
        skipped = run[-self.skip_count:]  # [the batches of the last rollback_skip_batches steps]
        self.recorded |= set(skipped)
        self.loader.skip |= set(skipped)
        target = self.good_step
        count = self.counts[target] = self.counts.get(target, 0) + 1
        event = {"step": step, "event": "rollback", "reason": reason, "to_step": target,
                 "skipped_batches": skipped, "rollbacks_to_this_checkpoint": count}
        self._write(event)
        where = f"step {step}: {reason}; global batches {skipped} recorded in {self.path}"
        if target is None or count > self.limit:
            logger.log_event(event)
        if target is None:
            raise RollbackError(f"{where}, but there is no checkpoint of this run to roll back to yet (the first "
                                f"is saved after step train.save_every); --resume starts again from step 0 "
                                f"without those batches")
        if count > self.limit:
            raise RollbackError(f"{where}; this is rollback {count} to the checkpoint of step {target}, more than "
                                f"train.max_rollbacks={self.limit}: skipping batches does not cure the fault; stopping")
        extra = load(checkpoint_path(Path(self.path.parent), target))
        self.load_state_dict(extra)
        event["rollback_seconds"] = time.perf_counter() - began
        logger.log_event(event)
        if self.groups.rank == 0:
            warnings.warn(f"{where}; rolled back to step {target} ({event['rollback_seconds']:.2f} s)", stacklevel=2)
        return target

    def _write(self, event: dict) -> None:
        """Rank 0: ``skipped_batches.json`` with every batch skipped so far and this
        process's rollbacks, written under another name and renamed (never half written)."""
        self.history.append(dict(event))
        if self.groups.rank != 0:
            return
        part = self.path.with_name(self.path.name + ".part")
        part.write_text(json.dumps({"skipped_batches": sorted(self.recorded), "rollbacks": self.history}, indent=1))
        os.replace(part, self.path)
