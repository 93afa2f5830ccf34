"""Rollback of a bad step (issue 28): ``train.on_nonfinite=rollback`` and
``train.on_loss_spike=rollback`` load the last checkpoint again and skip the global batches
that caused the fault, for good (``skipped_batches.json``, the checkpoints' extra state).

The reference for every rollback is a run told from the start to skip the same global
batches (``train.skip_batches``): the losses after the rollback must equal it exactly
(``train.deterministic``, the same layout). Faults are injected by a ``FaultPlan`` handed
to ``train`` (:mod:`moe_fold.training.faults`): ``batch=N`` is a bad batch (gone once skipped),
``step=N`` a fault that comes back at that step whatever the batch."""

from __future__ import annotations

import json
import math
import re
import statistics
import warnings

import pytest
import torch
from safetensors import safe_open

from moe_fold.config import ConfigError, load_config, validate
from moe_fold.data.loader import DataLoader, Sample
from moe_fold.launch import run_ranks
from moe_fold.training.checkpoint import read_index
from moe_fold.training.faults import FaultPlan
from moe_fold.training.rollback import SKIP_FILE, RollbackError
from moe_fold.training.train import read_metrics, train

import numpy as np

SMALL = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.keep_last=10",
    "train.deterministic=true", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
    "train.loss_spike_window=3", "train.async_save=false",
]
ROLLBACK = ["train.on_nonfinite=rollback", "train.on_loss_spike=rollback"]


def small_config(run_dir, cache_dir, *extra):
    return load_config("mixtral-tiny", SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", *extra])


def _train(config, faults: str = "", resume: bool = False):
    """One process, with the fault plan ``faults``."""
    return train(config, resume=resume, faults=FaultPlan.parse(faults))


def _events(run_dir, kind="rollback") -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == kind]


def _model_weights(checkpoint) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / "rank_00000.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("model/")}


# --------------------------------------------------------------------------- units

class _Numbered:
    seq_length = 2
    shuffle = "feistel"

    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        return Sample(np.asarray([i, i], np.int64), np.ones(1, np.float32), np.zeros(1, np.int64),
                      np.asarray([0, 1], np.int32))


def test_loader_passes_over_skipped_global_batches():
    """gbs 4 over dp 2: rank 1 of global batch g holds samples 4g+2, 4g+3; batches 1 and 2
    are skipped, their samples counted as consumed."""
    loader = DataLoader(_Numbered(), 4, 2, dp_rank=1, dp_size=2)
    loader.skip = {1, 2}
    got = []
    for _ in range(3):
        (batch,) = loader.global_batch()
        got.append((loader.last_batch, batch.tokens[:, 0].tolist()))
    assert got == [(0, [2, 3]), (3, [14, 15]), (4, [18, 19])]
    assert loader.state_dict() == {"consumed_samples": 20, "shuffle": "feistel"}


def test_config_rules_name_the_field():
    with pytest.raises(ConfigError) as err:
        validate(load_config("mixtral-tiny", ["parallel.ep=1", "train.on_loss_spike=retry", "train.on_nonfinite=undo",
                                              "train.rollback_skip_batches=0", "train.max_rollbacks=0",
                                              "train.skip_batches=[3, -1]", "train.save_every_minutes=5",
                                              "train.expected_mtbf_minutes=0"]), 1)
    text = str(err.value)
    for expected in ("train.on_loss_spike=retry must be one of log, stop, rollback",
                     "train.on_nonfinite=undo must be one of skip, stop, rollback",
                     "train.rollback_skip_batches=0", "train.max_rollbacks=0",
                     "train.skip_batches: -1 is not a global batch index",
                     "train.expected_mtbf_minutes=0",
                     "train.save_every_minutes=5.0 and train.expected_mtbf_minutes=0.0 both set the time between saves"):
        assert expected in text, (expected, text)
    with pytest.raises(ConfigError, match="train.on_loss_spike=rollback needs spike detection, but "
                                          "train.loss_spike_factor=0 turns it off"):
        validate(load_config("mixtral-tiny", ["parallel.ep=1", "train.on_loss_spike=rollback", "train.loss_spike_factor=0"]), 1)


# --------------------------------------------------------------------------- one process

def test_rollback_equals_a_run_that_never_saw_the_batches(tmp_path, cache_dir):
    """A NaN loss on global batch 4 (step 5) and a loss spike on batch 6 (step 6 after the
    first rollback); checkpoints every 3 steps. Each rolls back to step 3 and skips its
    batch; the run then equals the run told to skip batches 4 and 6, step by step and in
    its final weights. A resume from the checkpoint of step 3 (older than both rollbacks)
    skips them again from skipped_batches.json."""
    steps = ["train.steps=8", "train.save_every=3"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(small_config(run, cache_dir, *steps, *ROLLBACK), "nan@batch=4,spike@batch=6")
    reference = _train(small_config(ref, cache_dir, *steps, "train.skip_batches=[4, 6]"))
    assert len(result.losses) == 8 and result.losses == reference.losses
    messages = [str(w.message) for w in caught]
    assert any(re.fullmatch(r"step 5: non-finite loss or gradient norm \(train.on_nonfinite=rollback\); global "
                            r"batches \[4\] recorded in .*skipped_batches.json; rolled back to step 3 \(.* s\)", m)
               for m in messages), messages
    # The spike is judged against the window of the steps that stand (3, 4, 5 of the
    # reference), restored from the checkpoint: not against the undone steps'.
    median = statistics.median(reference.losses[2:5])
    assert any(m.startswith("step 6: loss spike: ") and f"x {median:.6g}, the median of the previous 3" in m
               for m in messages), (median, messages)
    assert all(math.isfinite(x) for x in result.losses)

    # metrics.jsonl: the bad steps, a rollback row after each, then the steps run again.
    rows = read_metrics(run)
    assert [(r["step"], r.get("event")) for r in rows] == [
        (1, None), (2, None), (3, None), (4, None), (5, None), (5, "rollback"),
        (4, None), (5, None), (6, None), (6, "rollback"), (4, None), (5, None), (6, None), (7, None), (8, None)]
    assert rows[4]["skipped"] and math.isnan(rows[4]["loss"])
    assert rows[8]["loss_spike"] and not rows[8]["skipped"]
    first, second = _events(run)
    assert {k: first[k] for k in ("to_step", "skipped_batches", "rollbacks_to_this_checkpoint")} == \
        {"to_step": 3, "skipped_batches": [4], "rollbacks_to_this_checkpoint": 1}
    assert first["reason"] == "non-finite loss or gradient norm (train.on_nonfinite=rollback)"
    assert {k: second[k] for k in ("to_step", "skipped_batches", "rollbacks_to_this_checkpoint")} == \
        {"to_step": 3, "skipped_batches": [6], "rollbacks_to_this_checkpoint": 2}
    assert second["reason"] == "loss spike (train.on_loss_spike=rollback)" and second["rollback_seconds"] >= 0
    # The rows of the steps that stand are the reference's (timings aside).
    final = [r for r in rows[10:]]
    assert [r["loss"] for r in final] == [r["loss"] for r in read_metrics(ref)[3:]]

    # The record a resume reads, and the checkpoints' extra state.
    record = json.loads((run / SKIP_FILE).read_text())
    assert record["skipped_batches"] == [4, 6] and [e["step"] for e in record["rollbacks"]] == [5, 6]
    assert read_index(run / "checkpoints" / "step_000006")["extra"]["skipped_batches"] == [4, 6]
    assert read_index(run / "checkpoints" / "step_000003")["extra"]["skipped_batches"] == []
    mine, theirs = _model_weights(run / "checkpoints" / "step_000008"), _model_weights(ref / "checkpoints" / "step_000008")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # A crash right after the rollbacks: only the checkpoint of step 3 (which knows of no
    # skipped batch) is left; the resume skips both from the file, without any fault.
    for step in (6, 8):
        for path in (run / "checkpoints" / f"step_{step:06d}").iterdir():
            path.unlink()
        (run / "checkpoints" / f"step_{step:06d}").rmdir()
    resumed = _train(small_config(run, cache_dir, *steps, *ROLLBACK), resume=True)
    assert resumed.first_step == 4 and resumed.losses == reference.losses[3:]
    # A fresh run in that folder starts without the record.
    _train(small_config(run, cache_dir, "train.steps=1", "train.save_every=3"))
    assert not (run / SKIP_FILE).exists()


def test_rollback_before_the_first_checkpoint_stops_and_resume_starts_without_the_batch(tmp_path, cache_dir):
    """A NaN on batch 1 (step 2) before the first checkpoint (step 5): nothing to return
    to, so the batch is recorded and the run stops with RollbackError; --resume then starts
    from step 0 without it and equals the run that skips batch 1."""
    steps = ["train.steps=4", "train.save_every=5"]
    run = tmp_path / "run"
    with pytest.raises(RollbackError, match=r"step 2: non-finite loss or gradient norm .*global batches \[1\] "
                                            r"recorded in .*; --resume starts again from step 0 without those"):
        _train(small_config(run, cache_dir, *steps, *ROLLBACK), "nan@batch=1")
    assert json.loads((run / SKIP_FILE).read_text())["skipped_batches"] == [1]
    assert _events(run)[0]["to_step"] is None
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    resumed = _train(small_config(run, cache_dir, *steps, *ROLLBACK), "nan@batch=1", resume=True)
    reference = _train(small_config(tmp_path / "ref", cache_dir, *steps, "train.skip_batches=[1]"))
    assert resumed.first_step == 1 and resumed.losses == reference.losses


def test_repeated_rollbacks_to_one_checkpoint_stop_at_the_limit(tmp_path, cache_dir):
    """A fault at step 4 whatever its batch: each rollback to step 2 skips one more batch
    and meets it again; the third exceeds train.max_rollbacks=2 and stops the run."""
    run = tmp_path / "run"
    config = small_config(run, cache_dir, "train.steps=6", "train.save_every=2", "train.max_rollbacks=2", *ROLLBACK)
    with pytest.raises(RollbackError, match=r"step 4: .*; this is rollback 3 to the checkpoint of step 2, more than "
                                            r"train.max_rollbacks=2: skipping batches does not cure the fault"):
        _train(config, "inf@step=4")
    events = _events(run)
    assert [(e["step"], e["to_step"], e["skipped_batches"], e["rollbacks_to_this_checkpoint"]) for e in events] == \
        [(4, 2, [3], 1), (4, 2, [4], 2), (4, 2, [5], 3)]
    assert json.loads((run / SKIP_FILE).read_text())["skipped_batches"] == [3, 4, 5]


def test_loss_spike_stop_and_log(tmp_path, cache_dir):
    """train.on_loss_spike=stop raises at the spike, before its step is saved; the default
    (log) only flags it and trains on."""
    config = small_config(tmp_path / "stop", cache_dir, "train.steps=6", "train.save_every=1",
                          "train.on_loss_spike=stop")
    with pytest.raises(FloatingPointError, match=r"step 5: loss spike: .* stopping \(train.on_loss_spike=stop\)"):
        _train(config, "spike@step=5")
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())[-1] == "step_000004"
    result = _train(small_config(tmp_path / "log", cache_dir, "train.steps=6", "train.save_every=6"), "spike@step=5")
    rows = read_metrics(tmp_path / "log")
    assert [r["loss_spike"] for r in rows] == [False] * 4 + [True, False] and len(result.losses) == 6
    assert not _events(tmp_path / "log")


# --------------------------------------------------------------------------- several ranks

def _rank_train(rank, world_size, config, faults=""):
    return train(config, faults=FaultPlan.parse(faults)).losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.ep=2", "parallel.pp=2"]], ids=["ep2xdp4", "pp2xep2xdp2"])
def test_rollback_on_four_ranks_with_ep_and_dp_equals_the_run_without_the_batches(tmp_path, cache_dir, layout):
    """4 ranks, ep 2 (dp 4, edp 2; or pp 2 with dp 2), expert re-placement every 2 steps,
    asynchronous saves and the Young/Daly clock (a collective each step): a NaN on batch 3
    and a spike on batch 6 roll back and skip them; every rank's losses equal the 4-rank
    run that skips batches 3 and 6."""
    common = [*layout, "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=8",
              "train.save_every=2", "moe.replace_every=2", "train.async_save=true", "train.expected_mtbf_minutes=0.01"]
    run = small_config(tmp_path / "run", cache_dir, *common, *ROLLBACK)
    ref = small_config(tmp_path / "ref", cache_dir, *common, "train.skip_batches=[3, 6]")
    got = run_ranks(_rank_train, 4, run, "nan@batch=3,spike@batch=6", timeout=300)
    want = run_ranks(_rank_train, 4, ref, timeout=300)
    assert len(got[0]) == 8 and all(losses == want[0] for losses in got + want)
    # Placement does not change the losses (dropless): the re-placements themselves must
    # match, which needs the checkpoint's placement and load window back after a rollback.
    def standing(run_dir) -> dict[int, dict]:
        rows = {}
        for r in read_metrics(run_dir):
            if "loss" in r:
                rows[r["step"]] = r  # a step run again after a rollback replaces the undone one
        return rows

    mine, theirs = standing(tmp_path / "run"), standing(tmp_path / "ref")
    assert sorted(mine) == list(range(1, 9))
    assert any("placement" in r for r in theirs.values())
    assert all(mine[s].get("placement") == theirs[s].get("placement") for s in theirs)
    events = _events(tmp_path / "run")
    assert [e["skipped_batches"] for e in events] == [[3], [6]]
    assert json.loads((tmp_path / "run" / SKIP_FILE).read_text())["skipped_batches"] == [3, 6]
