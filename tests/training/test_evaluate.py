"""Validation (issue 17): a held-out split by whole documents, the validation LM loss
and perplexity in metrics.jsonl as their own rows, the same value under every layout as
in one process, and training untouched by evaluating (losses identical with and
without, resume exact with evaluation on)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from moe_fold.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from moe_fold.data.loader import GPTDataset, split_documents, validation_dataset_from_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.evaluate import evaluate
from moe_fold.training.metrics import read_wandb_history
from moe_fold.training.train import read_metrics, train
from tests.training.test_train import small_config

ONE = ProcessGroups.single_process()
EVAL = ["train.eval_every=2", "train.eval_iters=2", "data.valid_fraction=0.02"]


def _train_rank(rank, world_size, config, **kwargs):
    return train(config, **kwargs)


def _rows(run_dir):
    rows = read_metrics(run_dir)
    return [r for r in rows if "loss" in r], [r for r in rows if "valid_loss" in r]


def test_split_documents_holds_out_the_last_documents():
    assert split_documents(10, 0.0, "train") is None
    assert split_documents(10, 0.25, "train") == (0, 7) and split_documents(10, 0.25, "valid") == (7, 10)
    assert split_documents(1000, 0.001, "valid") == (999, 1000)
    with pytest.raises(ValueError, match=r"data.valid_fraction=0.9 of 2 documents leaves no training document"):
        split_documents(2, 0.9, "train")
    with pytest.raises(ValueError, match="valid_fraction=0 holds out no validation documents"):
        split_documents(10, 0.0, "valid")


@pytest.mark.parametrize("packing", [False, True])
def test_a_document_range_reads_only_its_documents(tmp_path, packing):
    # Document d is made of the token d repeated: any token outside 5..9 is a leak.
    docs = [[d] * (7 + d) for d in range(10)]
    write_indexed_dataset(tmp_path / "ds", docs, vocab_size=16, eod_id=15)
    indexed = IndexedDataset(tmp_path / "ds")
    part = GPTDataset(indexed, 6, seed=1, packing=packing, documents=(5, 10))
    whole = GPTDataset(indexed, 6, seed=1, packing=packing)
    seen = np.concatenate([part.raw_sample(j).tokens for j in range(len(part))])
    assert set(seen.tolist()) <= {5, 6, 7, 8, 9, 15}
    assert {5, 9} <= set(seen.tolist())
    assert len(part) < len(whole)
    with pytest.raises(ValueError, match=r"documents=\[3, 3\] must be a non-empty range of the 10 documents"):
        GPTDataset(indexed, 6, seed=1, documents=(3, 3))


def test_valid_fraction_splits_the_training_data(tmp_path, cache_dir):
    from moe_fold.data.loader import dataset_from_config

    config = small_config(tmp_path, cache_dir, "data.valid_fraction=0.1")
    train_ds, valid_ds = dataset_from_config(config), validation_dataset_from_config(config)
    docs = len(train_ds.indexed.lengths)
    held = math.ceil(0.1 * docs)
    assert train_ds.documents == (0, docs - held) and valid_ds.documents == (docs - held, docs)
    assert validation_dataset_from_config(small_config(tmp_path, cache_dir)) is None
    write_indexed_dataset(tmp_path / "valid", [[7] * 100, [8] * 50], vocab_size=264, eod_id=257)
    other = validation_dataset_from_config(small_config(tmp_path, cache_dir, f"data.valid_path={tmp_path / 'valid'}"))
    assert other.indexed.prefix == tmp_path / "valid" and other.documents == (0, 2)
    small = small_config(tmp_path, cache_dir, "train.eval_iters=1")
    with pytest.warns(UserWarning, match=r"the validation data has 4 samples, fewer than train.eval_iters x "
                                         r"train.global_batch_size = 8: some are evaluated more than once"):
        evaluate(build_model(small, ONE), other, ONE, small, torch.device("cpu"))
    assert len(dataset_from_config(small_config(tmp_path, cache_dir, f"data.valid_path={tmp_path / 'valid'}"))) \
        == len(dataset_from_config(small_config(tmp_path, cache_dir)))  # the training data stays whole


def test_validation_rows_and_training_untouched_by_evaluating(tmp_path, cache_dir):
    """Deterministic: the same split with and without evaluation trains bit for bit the
    same (losses, grad norms and expert loads of every step, two of them after an
    evaluation); validation rows come every eval_every steps and at the last step."""
    opts = ["train.steps=4", "train.deterministic=true", "data.valid_fraction=0.02"]
    plain = train(small_config(tmp_path / "plain", cache_dir, *opts))
    console = Console(file=io.StringIO(), width=200)
    evaluated = train(small_config(tmp_path / "eval", cache_dir, *opts, "train.eval_every=2", "train.eval_iters=2",
                                   "wandb.mode=offline"), console=console, progress=False)
    assert evaluated.losses == plain.losses
    steps, valid = _rows(tmp_path / "eval")
    assert [r["step"] for r in valid] == [2, 4]
    history = {row["_step"]: row for row in read_wandb_history(evaluated.wandb_dir) if "valid_loss" in row}
    printed = console.file.getvalue()
    for r in valid:
        assert set(r) == {"step", "valid_loss", "valid_ppl", "valid_tokens"}
        assert r["valid_ppl"] == pytest.approx(math.exp(r["valid_loss"]), rel=1e-12)
        assert r["valid_tokens"] == 2 * 8 * 32  # eval_iters x global batch x seq_length, all labels count
        assert 0 < r["valid_loss"] < math.log(264) + 0.5
        assert history[r["step"]]["valid_loss"] == r["valid_loss"]
        assert history[r["step"]]["valid_ppl"] == r["valid_ppl"]
        assert (f"step {r['step']}/4 validation loss {r['valid_loss']:.4f} ppl {r['valid_ppl']:.2f} (512 tokens)"
                in printed)
    plain_steps = _rows(tmp_path / "plain")[0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [(r["grad_norm"], r["expert_load"]) for r in steps] == [(r["grad_norm"], r["expert_load"]) for r in plain_steps]


def test_resume_is_exact_with_evaluation_on(tmp_path, cache_dir):
    opts = ["train.steps=4", "train.deterministic=true", "optimizer.warmup_steps=1", *EVAL]
    straight = train(small_config(tmp_path / "straight", cache_dir, *opts))
    first = train(small_config(tmp_path / "split", cache_dir, *opts), stop_at=2)
    second = train(small_config(tmp_path / "split", cache_dir, *opts), resume=True)
    assert first.losses + second.losses == straight.losses
    assert _rows(tmp_path / "split")[1] == _rows(tmp_path / "straight")[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """Validation losses of one process: 2 steps, evaluating after each."""
    run_dir = tmp_path_factory.mktemp("one")
    train(small_config(run_dir, cache_dir, "train.steps=2", *EVAL, "train.eval_every=1"))
    return _rows(run_dir)[1]


@pytest.mark.parametrize("layout", [
    ["parallel.ep=2"],
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"],
    ["parallel.pp=2", "parallel.ep=2"],
    ["parallel.cp=2", "parallel.ep=2"],
    pytest.param(["parallel.cp=2", "parallel.ep=2", "parallel.dynamic_cp=true"], marks=pytest.mark.slow),
], ids=["ep2xdp2", "tp2xep2", "pp2xep2", "cp2xep2", "dynamic-cp2xep2"])
def test_validation_loss_is_the_same_under_every_layout(tmp_path, cache_dir, reference, layout):
    """4 ranks give the one-process validation loss (after 2 training steps, so the
    weights being evaluated are also the layout-invariant ones) through the same path
    as training: the dp shards, the tp/ep/cp splits, the pipeline schedule forward only."""
    config = small_config(tmp_path, cache_dir, "train.steps=2", *EVAL, "train.eval_every=1", *layout)
    run_ranks(_train_rank, 4, config, timeout=300)
    got = _rows(tmp_path)[1]
    assert [r["step"] for r in got] == [r["step"] for r in reference] == [1, 2]
    for a, b in zip(reference, got):
        assert b["valid_loss"] == pytest.approx(a["valid_loss"], rel=2e-5)
        assert b["valid_tokens"] == a["valid_tokens"]
