"""Checkpoint cadence from cost (issue 28): ``train.save_every_minutes`` and the Young/Daly
interval ``sqrt(2 x measured save stall x train.expected_mtbf_minutes)``, added to the
step rule ``train.save_every``. The decision is tested with a fake clock; one run checks
that saves follow the clock."""

from __future__ import annotations

import math

import pytest
import torch

from moe_fold.config import load_config
from moe_fold.training.cadence import STALLS_KEPT, Cadence, young_daly_interval
from moe_fold.training.train import read_metrics, train

from tests.training.test_rollback import small_config


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cadence(*overrides) -> tuple[Cadence, FakeClock]:
    clock = FakeClock()
    config = load_config("mixtral-tiny", list(overrides))
    return Cadence(config, torch.device("cpu"), world_size=1, clock=clock), clock


def test_young_daly_interval():
    assert young_daly_interval(2.0, 3600.0) == 120.0  # sqrt(2 * 2 * 3600)
    assert young_daly_interval(0.5, 60.0 * 240) == pytest.approx(120.0)  # a 0.5 s stall, 4 h between failures
    assert young_daly_interval(0.0, 100.0) == 0.0
    with pytest.raises(ValueError, match="stall_s=-1.0 must be >= 0 and mtbf_s=100.0 > 0"):
        young_daly_interval(-1.0, 100.0)
    with pytest.raises(ValueError, match="mtbf_s=0.0 > 0"):
        young_daly_interval(1.0, 0.0)


def test_steps_only_is_the_old_rule():
    cadence, clock = _cadence("train.save_every=5")
    clock.now += 1e9
    assert [s for s in range(1, 21) if cadence.due(s)] == [5, 10, 15, 20]
    assert not cadence.timed and cadence.interval_s is None
    assert cadence.describe() == "checkpoints every 5 steps"


def test_fixed_minutes_add_saves_between_the_steps():
    cadence, clock = _cadence("train.save_every=10", "train.save_every_minutes=2")
    assert cadence.interval_s == 120.0
    saved = []
    for step in range(1, 31):
        clock.now += 50.0  # a step takes 50 s: the clock is due every third step
        if cadence.due(step):
            saved.append(step)
            clock.now += 5.0  # the save
            cadence.saved(5.0)
    # 150 s after the start (step 3), then 50+50+50 after each save; step 10, 20, 30 by the step rule.
    assert saved == [3, 6, 9, 10, 13, 16, 19, 20, 23, 26, 29, 30]
    assert cadence.describe() == ("checkpoints every 10 steps or every 2 min (train.save_every_minutes), "
                                  "whichever first")


def test_young_daly_measures_first_then_follows_the_stalls():
    cadence, clock = _cadence("train.save_every=1000", "train.expected_mtbf_minutes=60")
    assert cadence.interval_s is None and "not known yet" in cadence.describe()
    assert cadence.due(1)  # nothing measured: save to measure the stall
    cadence.saved(2.0)  # interval sqrt(2 * 2 * 3600) = 120 s
    assert cadence.interval_s == 120.0
    clock.now += 119.0
    assert not cadence.due(2)
    clock.now += 1.0
    assert cadence.due(3)
    cadence.saved(8.0)  # median(2, 8) = 5: sqrt(2 * 5 * 3600) = 189.7 s
    assert cadence.interval_s == pytest.approx(math.sqrt(36000.0))
    for stall in (8.0, 0.5, 0.5, 0.5):  # the window keeps the last STALLS_KEPT: 8, 8, 0.5 x 3 (not the 2)
        cadence.saved(stall)
    assert STALLS_KEPT == 5 and cadence.interval_s == pytest.approx(60.0)  # median 0.5: sqrt(3600)
    assert "interval 60.0 s from a stall of 0.500 s" in cadence.describe()


def test_saves_follow_the_clock_in_a_run(tmp_path, cache_dir):
    """save_every=1000 never fires in 4 steps. A tiny save_every_minutes saves every step;
    a huge one only the last. expected_mtbf_minutes saves step 1 (to measure the stall),
    then logs each save's stall and the interval sqrt(2 x median stall x MTBF)."""
    def run(name, *extra):
        train(small_config(tmp_path / name, cache_dir, "train.steps=4", "train.save_every=1000", *extra))
        return sorted(int(p.name[5:]) for p in (tmp_path / name / "checkpoints").iterdir())

    assert run("often", "train.save_every_minutes=1e-9") == [1, 2, 3, 4]
    assert run("rarely", "train.save_every_minutes=1000") == [4]
    rows = [r for r in read_metrics(tmp_path / "rarely") if r.get("event") == "save_interval"]
    assert rows[0] == {"step": 0, "event": "save_interval", "save_interval_s": 60000.0}
    assert run("mtbf", "train.expected_mtbf_minutes=1000") == [1, 4]
    rows = [r for r in read_metrics(tmp_path / "mtbf") if r.get("event") == "save_interval"]
    assert [r["step"] for r in rows] == [0, 1, 4] and rows[0]["save_interval_s"] is None
    stalls = [r["save_stall_s"] for r in rows[1:]]
    assert rows[1]["save_interval_s"] == pytest.approx(math.sqrt(2 * stalls[0] * 60000.0))
    assert rows[2]["save_interval_s"] == pytest.approx(math.sqrt(2 * (stalls[0] + stalls[1]) / 2 * 60000.0))


def _vote_in_the_stop_check(rank, world_size):
    """Rank 0's clock is due at step 1, rank 1's is not: after the stop check both save
    step 1, and the decision cost no all-reduce of its own."""
    import time as _time

    import torch.distributed as dist

    from moe_fold.training import stop as stop_module
    from moe_fold.training.stop import ExitSignals, StopRule

    clock = FakeClock()
    config = load_config("mixtral-tiny", ["train.save_every=1000", "train.save_every_minutes=1"])
    cadence = Cadence(config, torch.device("cpu"), world_size, clock=clock)
    clock.now += 61.0 if rank == 0 else 1.0
    calls = []
    real = stop_module.all_reduce_
    stop_module.all_reduce_ = lambda t, group, op="sum": (calls.append(t.tolist()), real(t, group, op=op))
    import moe_fold.training.cadence as cadence_module
    cadence_module.all_reduce_ = stop_module.all_reduce_
    with ExitSignals([]) as signals:
        rule = StopRule(config, signals, torch.device("cpu"), world_size, _time.monotonic(), votes=[cadence])
        stop = rule.check(1)
    due = cadence.due(1)
    again = cadence.due(1)  # not agreed for this step any more: a collective of its own
    dist.barrier()
    return stop, due, again, calls


def test_the_clock_rides_in_the_stop_checks_all_reduce():
    from moe_fold.launch import run_ranks

    for rank, (stop, due, again, calls) in enumerate(run_ranks(_vote_in_the_stop_check, 2)):
        assert stop is None and due is True and again is True
        # One all-reduce for the stop check carrying [signal, budget, clock], then the second
        # due()'s own one-flag all-reduce.
        assert calls == [[0, 0, int(rank == 0)], [int(rank == 0)]], calls
