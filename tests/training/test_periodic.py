"""The training loop's periodic actions (moe_fold/training/periodic.py), each alone on a
hand-made step record with stand-ins for its collaborators: when each one acts, what it
writes on the record, and in what order it calls what it is given. The whole loop runs
them in tests/training/test_train.py, tests/training/test_checkpoint.py, tests/training/test_evaluate.py, tests/training/test_replace.py and
tests/training/test_stop.py."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import pytest

from moe_fold.training.periodic import (
    CheckStop, Evaluate, LogStep, ReplaceExperts, SaveCheckpoint, StepRecord, WatchLossSpikes, at_step,
    stopping,
)
from moe_fold.training.numerics import LossSpikes
from moe_fold.training.stop import Stop


def record(step: int = 1, loss: float = 2.0, **fields) -> StepRecord:
    base = dict(lm_loss=1.5, grad_norm=0.5, lr=1e-3, skipped=False, nonfinite_module=None,
                losses={"aux_loss": 0.25, "z_loss": None, "mtp_loss": None}, routing={"expert_load": [[3, 1]]},
                began=0.0)
    base.update(fields)
    return StepRecord(step, loss, **base)


class Calls(list):
    """Stand-in collaborators append what was called, in order."""

    def method(self, name, result=None):
        return lambda *args, **kwargs: self.append((name, *args)) or result


def test_row_is_the_metrics_line():
    r = record(3, skipped=True, nonfinite_module="layers.0.attn", extra={"rolled_back": True})
    r.seconds = 0.5
    row = r.row(tokens_per_step=100)
    assert list(row) == ["step", "loss", "lm_loss", "grad_norm", "lr", "tokens_per_s", "skipped", "loss_spike",
                         "nonfinite_module", "aux_loss", "z_loss", "mtp_loss", "expert_load", "rolled_back"]
    assert row["tokens_per_s"] == 200 and row["step"] == 3 and row["nonfinite_module"] == "layers.0.attn"
    # A finite step's row has no nonfinite_module field.
    finite = record(4)
    finite.seconds = 1.0
    assert "nonfinite_module" not in finite.row(100)


def test_replace_experts_waits_for_the_parameters_then_adds_what_moved():
    calls = Calls()
    optimizer = SimpleNamespace(wait_params=calls.method("wait_params"))
    replacer = SimpleNamespace(after_step=calls.method("after_step", {"replace_moves": 2}), every=2)
    r = record(4)
    ReplaceExperts(replacer=replacer, optimizer=optimizer, beat=calls.method("beat"))(r)
    # A re-placement step (4 of every 2) tells the hang detection first.
    assert calls == [("wait_params",), ("beat", 4, "replace"), ("after_step", 4, [[3, 1]])]
    assert r.routing == {"expert_load": [[3, 1]], "replace_moves": 2}
    # Without a replacer: nothing, not even the wait.
    calls.clear()
    ReplaceExperts(replacer=None, optimizer=optimizer)(record(5))
    assert calls == []


def test_watch_loss_spikes_flags_and_warns_above_factor_times_the_median():
    watch = WatchLossSpikes(spikes=LossSpikes(factor=2.0, window=2), warn=True)
    flags = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, loss in enumerate([1.0, 1.0, 1.9, 5.0], start=1):
            r = record(step, loss)
            watch(r)
            flags.append(r.loss_spike)
    assert flags == [False, False, False, True]
    assert [str(w.message) for w in caught] == [
        "step 4: loss spike: 5 > train.loss_spike_factor=2.0 x 1.45, the median of the previous 2 losses"]
    quiet = WatchLossSpikes(spikes=LossSpikes(factor=2.0, window=1), warn=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(record(1, 1.0))
        r = record(2, 3.0)
        quiet(r)
    assert r.loss_spike
    # train.on_loss_spike=stop: raise before the step is saved.
    stopping_watch = WatchLossSpikes(spikes=LossSpikes(factor=2.0, window=1), warn=False, stop=True)
    stopping_watch(record(1, 1.0))
    with pytest.raises(FloatingPointError, match=r"step 2: loss spike: 3 > .*; stopping \(train.on_loss_spike=stop\)"):
        stopping_watch(record(2, 3.0))


def test_log_step_times_the_step_and_logs_its_row():
    rows = []
    logger = SimpleNamespace(log=lambda row, collector: rows.append((row, collector)))
    r = record(2, began=time.perf_counter())
    LogStep(logger=logger, collector="collector", tokens_per_step=64)(r)
    assert r.seconds > 0
    (row, collector), = rows
    assert collector == "collector" and row == r.row(64)


def test_evaluate_every_n_steps_and_at_the_final_step():
    rows = []
    logger = SimpleNamespace(log_eval=rows.append)
    def run(every: int, validation_loss):
        return SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(eval_every=every, steps=5)),
                               validation_loss=validation_loss)

    every_2 = Evaluate(run=run(2, lambda: {"valid_loss": 1.0}), logger=logger)
    for step in range(1, 6):
        every_2(record(step))
    assert rows == [{"step": s, "valid_loss": 1.0} for s in (2, 4, 5)]
    rows.clear()
    never = Evaluate(run=run(0, lambda: pytest.fail("evaluated with eval_every=0")), logger=logger)
    for step in range(1, 6):
        never(record(step))
    assert rows == []


def test_check_stop_notes_the_stop_and_says_so():
    said = []
    stop = Stop(3, "SIGTERM received", 143)
    stops = SimpleNamespace(check=lambda step: stop if step == 3 else None)
    check = CheckStop(stops=stops, console=SimpleNamespace(print=said.append))
    first, third = record(1), record(3)
    check(first)
    check(third)
    assert first.stop is None and third.stop is stop
    assert said == ["stopping after step 3: SIGTERM received; writing its checkpoint"]
    CheckStop(stops=stops, console=None)(record(3))  # other ranks: no console, no output


@pytest.mark.parametrize("with_replacer", [False, True])
def test_save_checkpoint_when_due_with_the_data_position_and_placement(with_replacer):
    calls = Calls()
    run = SimpleNamespace(optimizer=SimpleNamespace(wait_params=calls.method("wait_params")),
                          loader=SimpleNamespace(state_dict=lambda: {"consumed_samples": 8}),
                          replacer=SimpleNamespace(state_dict=lambda: {"0": [[0, 1]]}) if with_replacer else None,
                          rollbacks=SimpleNamespace(state_dict=lambda: {"skipped": []}, saved=calls.method("rolls")),
                          state_model="model", scheduler="scheduler")
    saver = SimpleNamespace(save=lambda step, *args: calls.append(("save", step, *args)) or f"ckpt/step_{step}")
    cadence = SimpleNamespace(due=lambda step: step % 3 == 0, interval_s=None, timed=False,
                              saved=lambda stall: calls.append(("cadence", stall >= 0)))
    save = SaveCheckpoint(run=run, saver=saver, cadence=cadence, logger=None, when=[at_step(5), stopping])
    records = [record(step) for step in range(1, 6)]
    records[0].stop = Stop(1, "train.exit_at_step=1 reached", 0)
    for r in records:
        save(r)
    assert [r.checkpoint for r in records] == ["ckpt/step_1", None, "ckpt/step_3", None, "ckpt/step_5"]
    extra = {"step": 1, "data": {"consumed_samples": 8}, "skipped": []}
    if with_replacer:
        extra["experts"] = {"0": [[0, 1]]}
    # After the save: the cadence hears its stall, the rollbacks the step to return to.
    assert calls[:4] == [("wait_params",), ("save", 1, "model", run.optimizer, "scheduler", extra), ("cadence", True),
                         ("rolls", 1)]
    assert [c[1] for c in calls if c[0] == "save"] == [1, 3, 5]
