"""The training loop's set-up (moe_fold/training/run_setup.py) and its step
(``moe_fold.training.train.run_step``), each alone in one process: what the set-up builds
for a config, what a run starts from (fresh, resumed), and what one step does to the
weights and reports, finite or not. The whole loop is tested in tests/training/test_train.py."""

from __future__ import annotations

import pytest
import torch

from moe_fold.layout import ProcessGroups
from moe_fold.training.checkpoint import latest_checkpoint
from moe_fold.training.run_setup import load_start_state, set_up_run
from moe_fold.training.train import run_step, train

from tests.training.test_train import small_config


def _set_up(tmp_path, cache_dir, *extra):
    return set_up_run(small_config(tmp_path, cache_dir, *extra), torch.device("cpu"),
                      ProcessGroups.single_process())


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_set_up_builds_what_the_config_asks_for(tmp_path, cache_dir):
    plain = _set_up(tmp_path / "plain", cache_dir)
    assert plain.state_model is plain.model and plain.master is None
    assert plain.replacer is None and plain.valid_dataset is None and plain.dynamic_cp is None
    assert plain.train_params == list(plain.model.parameters())
    assert plain.loader.consumed_samples == 0 and (tmp_path / "plain").is_dir()
    rich = _set_up(tmp_path / "rich", cache_dir, "train.precision=bf16", "moe.replace_every=2", "train.eval_every=2",
                  "data.valid_fraction=0.1")
    # bf16: the optimizer and checkpoints hold the float32 masters; the model computes in bf16.
    assert rich.state_model is rich.master.master and rich.state_model is not rich.model
    assert {p.dtype for p in rich.model.parameters()} == {torch.bfloat16}
    assert rich.train_params == list(rich.master.master.parameters())
    assert rich.replacer is not None and rich.valid_dataset is not None
    # The same seed, the same initial weights, whatever else the config sets.
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), rich.master.master.parameters()))


def test_start_state_fresh_or_resumed(tmp_path, cache_dir):
    run = _set_up(tmp_path, cache_dir)
    assert load_start_state(run, resume=True) == (0, None)  # nothing to resume: a fresh start
    train(small_config(tmp_path, cache_dir, "train.steps=2", "train.save_every=1"), progress=False)
    saved = latest_checkpoint(tmp_path)
    run = _set_up(tmp_path, cache_dir, "train.steps=4")
    fresh = _weights(run.model)
    assert load_start_state(run, resume=False) == (0, None)
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in fresh.items())
    assert load_start_state(run, resume=True) == (2, str(saved))
    assert run.loader.consumed_samples == 2 * run.config.train.global_batch_size
    assert run.scheduler.state_dict() == {"step": 2}
    assert any(not torch.equal(v, run.model.state_dict()[k]) for k, v in fresh.items())


def test_step_updates_the_weights_and_reports(tmp_path, cache_dir):
    run = _set_up(tmp_path, cache_dir)
    before = _weights(run.model)
    lr = run.scheduler.get_last_lr()
    record = run_step(run, 1)
    assert record.step == 1 and not record.skipped and record.nonfinite_module is None
    assert record.lr == lr and record.grad_norm > 0
    # The loss adds the routers' weighted losses (aux and z are on) to the LM loss.
    assert record.loss > record.lm_loss > 0 and "weighted_loss" not in record.routing
    assert len(record.routing["expert_load"]) == run.config.model.num_layers
    assert all(p.grad is None for p in run.model.parameters())
    assert any(not torch.equal(v, run.model.state_dict()[k]) for k, v in before.items())
    assert run.loader.consumed_samples == run.config.train.global_batch_size
    assert run.scheduler.state_dict() == {"step": 1}


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_a_nonfinite_step_takes_no_optimizer_step(tmp_path, cache_dir, on_nonfinite):
    run = _set_up(tmp_path, cache_dir, f"train.on_nonfinite={on_nonfinite}")
    before = _weights(run.model)
    run.model.layers[1].attn.register_forward_hook(lambda module, args, out: out * float("nan"))
    if on_nonfinite == "stop":
        with pytest.raises(FloatingPointError, match="step 1: loss nan.*first non-finite output: layers.1.attn"):
            run_step(run, 1)
        return
    with pytest.warns(UserWarning, match="first non-finite output: layers.1.attn; step skipped"):
        record = run_step(run, 1)
    assert record.skipped and record.nonfinite_module == "layers.1.attn"
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in run.model.parameters())
    # The data and the schedule move on: the next step takes the next global batch.
    assert run.loader.consumed_samples == run.config.train.global_batch_size
    assert run.scheduler.state_dict() == {"step": 1}


def _untyped_or_positional(cls) -> list[str]:
    """The constructor parameters of ``cls`` that can be passed by position or are typed
    ``Any`` (annotations are read as written: ``from __future__ import annotations``)."""
    import inspect

    out = []
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            out.append(f"{cls.__name__}.{name} is not keyword-only")
        if p.annotation is inspect.Parameter.empty:
            out.append(f"{cls.__name__}.{name} is untyped")
        elif "Any" in str(p.annotation):
            out.append(f"{cls.__name__}.{name}: {p.annotation}")
    return out


def test_run_and_the_periodic_actions_are_typed_and_built_by_keyword():
    """Collaborators have their real types (no ``Any`` with the type in a comment) and are
    built by keyword, so a reader (and a type checker) can follow each one."""
    from moe_fold.training.periodic import (
        CheckStop, Evaluate, LogStep, ReplaceExperts, RollBack, SaveCheckpoint, WatchLossSpikes,
    )
    from moe_fold.training.run_setup import Run

    classes = [Run, ReplaceExperts, WatchLossSpikes, LogStep, RollBack, Evaluate, CheckStop, SaveCheckpoint]
    assert [problem for cls in classes for problem in _untyped_or_positional(cls)] == []
    # The check itself: a positional, untyped collaborator is reported.
    class Planted:
        def __init__(self, run, *, logger: Any):  # noqa: F821 (an annotation, never evaluated)
            pass
    assert _untyped_or_positional(Planted) == ["Planted.run is not keyword-only", "Planted.run is untyped",
                                               "Planted.logger: Any"]
