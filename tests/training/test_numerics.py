"""Reliability (issue 11), numerics: a NaN/inf injected into a forward output or a
gradient skips the step (train.on_nonfinite=skip: the weights stay as they were, the
checkpoints stay finite) or stops the run before anything of that step is saved (stop);
the message and metrics.jsonl name the first module whose output went non-finite. A loss
above train.loss_spike_factor x the running median is flagged (loss_spike, a warning).

Faults are injected by the collaborators handed to ``train``: a model builder that hooks
the model, keyed on the step a wrapped forward-backward counts; the loop runs unchanged."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from safetensors import safe_open

from moe_fold.config import load_config
from moe_fold.launch import RankError, run_ranks
from moe_fold.models.model import build_model
from moe_fold.training.numerics import LossSpikes, first_nonfinite_module
from moe_fold.training.step import forward_backward
from moe_fold.training.train import read_metrics, train

SMALL = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.save_every=1", "train.keep_last=10",
    "train.deterministic=true", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
]


def small_config(run_dir, cache_dir, *extra):
    return load_config("mixtral-tiny", SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", *extra])


def faults(plan: dict, rank: int = 0) -> dict:
    """The collaborators that plant ``plan`` in a run (``train(config, **faults(plan))``):
    ``plan`` is {step: [(rank, module name, kind)]}, kind ``nan_output`` (the module's
    output becomes NaN), ``inf_grad`` (the gradient reaching the module's output becomes
    inf; the forward stays finite) or ``scale_output`` (x10: a loss spike when the module
    is the model, whose output is the loss). The step is counted by the training
    forward-backwards (a fresh run, no rollback)."""
    current = {"step": 0}

    def stepping(*args, forward_only=False, **kwargs):
        if not forward_only:  # not the diagnosis's forwards of a non-finite step
            current["step"] += 1
        return forward_backward(*args, forward_only=forward_only, **kwargs)

    def hook(name: str, kind: str):
        def fire(module, args, output):
            if current["step"] not in plan or (rank, name, kind) not in plan[current["step"]]:
                return None
            if kind == "nan_output":
                return output * float("nan")
            if kind == "scale_output":
                return output * 10
            if output.requires_grad:
                output.register_hook(lambda g: g * float("inf"))
            return None
        return fire

    def build(config, groups):
        model = build_model(config, groups)
        modules = dict(model.named_modules())
        for entries in plan.values():
            for r, name, kind in entries:
                if r == rank:
                    modules[name].register_forward_hook(hook(name, kind))
        return model

    return {"build_model": build, "forward_backward": stepping}


def _weights(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "rank_00000.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _model_weights(path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _weights(path).items() if k.startswith("model/")}


def test_first_nonfinite_module_names_the_earliest_output():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    x = torch.ones(1, 2)
    assert first_nonfinite_module(net, lambda: net(x)) is None
    with torch.no_grad():
        net[1][1].weight[0, 0] = float("inf")
    # The inner Linear returns first; its parent Sequential and the root follow it.
    assert first_nonfinite_module(net, lambda: net(x)) == ("1.1", 2)  # after "0" and "1.0"
    assert all(not m._forward_hooks for m in net.modules())  # the hooks are gone


def test_loss_spikes_against_the_median_of_the_window():
    spikes = LossSpikes(factor=2.0, window=3)
    flags = [spikes.check(x) for x in (5.0, 1.0, 1.2, 3.0, 2.0, float("nan"), 2.5, 4.9, 5.1)]
    # medians: -, -, -, 1.2, 1.2, 2.0, 2.0, 2.5, 2.5 (the NaN does not join the window)
    assert flags == [False, False, False, True, False, False, False, False, True]
    assert not any(LossSpikes(0, 1).check(x) for x in (1.0, 100.0))
    with pytest.raises(ValueError, match="train.loss_spike_window=0 must be >= 1"):
        LossSpikes(2.0, 0)


def test_nonfinite_forward_and_gradient_skip_their_steps(tmp_path, cache_dir):
    """NaN out of layers.1.attn at step 3 and an inf gradient into layers.0.mlp at step 5:
    both steps are skipped with a warning; the weights saved after them are those of the
    step before, every checkpoint is finite, and the other steps train normally."""
    plan = {3: [(0, "layers.1.attn", "nan_output")], 5: [(0, "layers.0.mlp", "inf_grad")]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(small_config(tmp_path, cache_dir, "train.steps=6"), **faults(plan))
    records = read_metrics(tmp_path)
    assert [r["skipped"] for r in records] == [False, False, True, False, True, False]
    assert records[2]["nonfinite_module"] == "layers.1.attn" and math.isnan(records[2]["loss"])
    assert records[4]["nonfinite_module"] is None  # the forward was finite: the backward went wrong
    # (inf times the zeros of a backward gives NaN as well as inf)
    assert math.isfinite(records[4]["loss"]) and not math.isfinite(records[4]["grad_norm"])
    assert all("nonfinite_module" not in r for i, r in enumerate(records) if i not in (2, 4))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for i, r in enumerate(records)
               if i not in (2, 4))
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("step 3: loss nan, gradient norm nan; first non-finite output: layers.1.attn; "
                            "step skipped (train.on_nonfinite=skip)") for m in messages), messages
    assert any(m.startswith(f"step 5: loss {records[4]['lm_loss']}, gradient norm ") and
               "first non-finite output: none (the forward ran again is finite)" in m for m in messages), messages
    ckpts = tmp_path / "checkpoints"
    for skipped in (3, 5):
        before, after = _model_weights(ckpts / f"step_{skipped - 1:06d}"), _model_weights(ckpts / f"step_{skipped:06d}")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for step in range(1, 7):
        assert all(torch.isfinite(t).all() for t in _weights(ckpts / f"step_{step:06d}").values())
    changed = _model_weights(ckpts / "step_000004")
    assert any(not torch.equal(changed[k], _model_weights(ckpts / "step_000003")[k]) for k in changed)
    assert result.losses[1] == records[1]["loss"]


def test_nonfinite_stops_before_saving_when_configured(tmp_path, cache_dir):
    with pytest.raises(FloatingPointError) as err:
        train(small_config(tmp_path, cache_dir, "train.steps=5", "train.on_nonfinite=stop"),
              **faults({3: [(0, "layers.1.attn", "nan_output")]}))
    assert str(err.value) == ("step 3: loss nan, gradient norm nan; first non-finite output: layers.1.attn; "
                              "stopping (train.on_nonfinite=stop)")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_loss_spike_is_flagged_in_metrics_and_warned(tmp_path, cache_dir):
    """The loss x10 at step 5 (factor 3, window 3): flagged there only."""
    with pytest.warns(UserWarning) as caught:
        train(small_config(tmp_path, cache_dir, "train.steps=6", "train.loss_spike_factor=3",
                           "train.loss_spike_window=3"), **faults({5: [(0, "", "scale_output")]}))
    records = read_metrics(tmp_path)
    assert [r["loss_spike"] for r in records] == [False, False, False, False, True, False]
    previous = sorted(r["loss"] for r in records[1:4])
    spikes = [str(w.message) for w in caught if "loss spike" in str(w.message)]
    assert spikes == [f"step 5: loss spike: {records[4]['loss']:.6g} > train.loss_spike_factor=3.0 x "
                      f"{previous[1]:.6g}, the median of the previous 3 losses"]


def _train_with_faults(rank, world_size, config, plan):
    return train(config, **faults(plan, rank))


@pytest.mark.slow
def test_nonfinite_on_one_rank_is_named_with_its_rank_and_stops_every_rank(tmp_path, cache_dir):
    """ep2 on 2 ranks: rank 1's experts of layer 0 output NaN at step 2: every rank sees
    the non-finite global loss; the message names layers.0.mlp.experts on rank 1."""
    config = small_config(tmp_path, cache_dir, "train.steps=3", "train.on_nonfinite=stop", "parallel.ep=2")
    with pytest.raises(RankError) as err:
        run_ranks(_train_with_faults, 2, config, {2: [(1, "layers.0.mlp.experts", "nan_output")]}, timeout=240)
    assert ("FloatingPointError: step 2: loss nan, gradient norm nan; first non-finite output: "
            "layers.0.mlp.experts (rank 1); stopping (train.on_nonfinite=stop)") in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
