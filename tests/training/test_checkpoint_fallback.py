"""A damaged newest checkpoint: resume falls back to the one before it, on every rank
together, moves the damaged one aside (never deleted), and ends with the losses of a run
that was never interrupted. With no intact checkpoint the run stops and nothing is written
(tests/training/test_reliability_inputs.py)."""

from __future__ import annotations

import warnings

import pytest

from moe_fold.config import load_config
from moe_fold.launch import run_ranks
from moe_fold.training.train import read_metrics, train
from tests.training.test_reliability_inputs import SMALL, _alter, _truncate, snapshot

STEPS = 4


def _opts(run_dir, cache):
    return SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={cache}", "train.deterministic=true",
                    "train.keep_last=3"]


def _train_rank(rank, world_size, opts, resume):
    train(load_config("mixtral-tiny", opts), resume=resume, progress=False)


@pytest.mark.parametrize("damage", [
    lambda p: _alter(p / "rank_00000.safetensors", -5),
    lambda p: _truncate(p / "index.json", 50),
], ids=["altered-shard", "truncated-index"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    cache = tmp_path / "cache"
    whole = train(load_config("mixtral-tiny", _opts(tmp_path / "whole", cache) + [f"train.steps={STEPS}"]),
                  progress=False)
    run_dir = tmp_path / "run"
    train(load_config("mixtral-tiny", _opts(run_dir, cache) + ["train.steps=3"]), progress=False)
    ckpts = run_dir / "checkpoints"
    damage(ckpts / "step_000003")
    older = snapshot(ckpts / "step_000002")
    with pytest.warns(UserWarning, match=r"resuming from .*step_000002: the newer checkpoint .*step_000003 is "
                                         r"damaged \(.*\); it is moved aside to step_000003\.damaged-"):
        resumed = train(load_config("mixtral-tiny", _opts(run_dir, cache) + [f"train.steps={STEPS}"]),
                        resume=True, progress=False)
    assert resumed.first_step == 3
    assert resumed.losses == whole.losses[2:]
    assert [r["loss"] for r in read_metrics(run_dir)] == whole.losses
    moved = [p.name for p in ckpts.iterdir() if ".damaged-" in p.name]
    assert len(moved) == 1 and moved[0].startswith("step_000003.damaged-")
    assert (ckpts / "step_000002").is_dir() and snapshot(ckpts / "step_000002") == older


@pytest.mark.slow
def test_damage_on_one_rank_makes_every_rank_fall_back(tmp_path):
    """ep2 on 2 ranks, rank 1's shard of the newest checkpoint altered: rank 0 could load it,
    but both resume from the step before, with the uninterrupted run's losses."""
    cache = tmp_path / "cache"
    opts = [o for o in _opts(tmp_path / "whole", cache) if o != "parallel.ep=1"] + ["parallel.ep=2"]
    run_ranks(_train_rank, 2, opts + [f"train.steps={STEPS}"], False, timeout=240)
    whole = [r["loss"] for r in read_metrics(tmp_path / "whole")]
    opts = [o.replace(str(tmp_path / "whole"), str(tmp_path / "run")) for o in opts]
    run_ranks(_train_rank, 2, opts + ["train.steps=3"], False, timeout=240)
    _alter(tmp_path / "run" / "checkpoints" / "step_000003" / "rank_00001.safetensors", -5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_ranks(_train_rank, 2, opts + [f"train.steps={STEPS}"], True, timeout=240)
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == whole
    assert any(".damaged-" in p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
