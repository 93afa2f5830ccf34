"""Reliability (issue 11), routing extremes: every token to one expert (so one ep rank
receives every token and the other none), experts that receive nothing for every step,
top-k = num_experts. No hang (the runs finish within their timeout), no NaN, and the
dropless results equal the single-process computation.

- Dispatchers: tests/dispatch/test_dispatcher.py's global-data harness (every dispatcher and dropless
  mode vs the loop over tokens, forward and backward, bit for bit or within
  ``summation_bound`` where the order of a token's sum differs) on the extreme cases; its
  own matrix already covers one expert for all tokens, empty ranks and all-empty.
- Training: routing forced through the router's expert bias (sigmoid scores, the bias
  fixed with bias_update_rate=0), ep2 on 2 ranks against one process, step by step; the
  experts no token reached keep their initial weights exactly (no weight decay), in both
  runs' checkpoints (every rank's shard of the ep2 run).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

import moe_fold.models.model as model_module
from moe_fold.config import load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ProcessGroups
from moe_fold.training.train import read_metrics, train
from tests.dispatch.test_dispatcher import Case, run_blocking_and_async, check_plan, configs_for, rank_main

E = 8
SMALL = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.save_every=1000", "train.steps=4",
    "optimizer.warmup_steps=1", "optimizer.weight_decay=0", "wandb.mode=disabled", "parallel.ep=1",
]
FORCED = ["moe.score_function=sigmoid", "moe.expert_bias=true", "moe.bias_update_rate=0"]


# --------------------------------------------------------------------------- dispatchers

def extreme_cases(world_size: int, num_experts: int) -> list[Case]:
    sizes = tuple(4 + r for r in range(world_size))
    return [
        Case("topk_all", sizes, num_experts, num_experts, seed=1),
        Case("one_expert_top1", sizes, num_experts, 1, "one_expert", seed=2),
        Case("topk_all_one_rank_empty", sizes[:-1] + (0,), num_experts, num_experts, seed=3),
    ]


@pytest.mark.parametrize("world_size, layouts", [
    (1, [({}, 4)]),
    (2, [({"ep": 2}, 4), ({"etp": 2}, 4), ({"ep": 2}, 2)]),
])
def test_dispatchers_stay_exact_on_extreme_routing(world_size, layouts):
    plans = [(kw, extreme_cases(world_size, e)) for kw, e in layouts]
    if world_size == 1:
        groups = ProcessGroups.single_process()
        results = [[[[run_blocking_and_async(0, c, groups, cfg) for cfg in configs_for(c)] for c in cases] for _, cases in plans]]
    else:
        results = run_ranks(rank_main, world_size, plans, timeout=120)
    check_plan(world_size, plans, results)


# --------------------------------------------------------------------------- training

def _biased_build(bias: list[float]):
    build = model_module.build_model

    def wrapped(config, groups):
        model = build(config, groups)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("router.expert_bias"):
                    buf.copy_(torch.tensor(bias))
        return model
    return wrapped


def _train_biased(rank, world_size, config, bias):
    return train(config, build_model=_biased_build(bias)) if bias is not None else train(config)


def _initial_experts(config) -> dict[str, torch.Tensor]:
    """The expert weights the loop starts from (it seeds with train.seed, then builds)."""
    torch.manual_seed(config.train.seed)
    model = model_module.build_model(config, ProcessGroups.single_process())
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}


def _final_experts(run_dir) -> dict[str, torch.Tensor]:
    """The global expert weights of the step-4 checkpoint, put together from the pieces of
    every rank's shard (under ep each shard holds its ranks' experts)."""
    folder = run_dir / "checkpoints" / "step_000004"
    index = json.loads((folder / "index.json").read_text())
    out = {}
    for name, entry in index["tensors"].items():
        if not (name.startswith("model/") and ".experts." in name):
            continue
        whole = torch.full(entry["shape"], float("nan"))
        for piece in entry["pieces"]:
            with safe_open(str(folder / piece["file"]), framework="pt") as f:
                part = f.get_tensor(piece["key"])
            whole[tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["sizes"]))] = part
        out[name.removeprefix("model/")] = whole
    return out


@pytest.mark.parametrize("case, extra, bias, used", [
    # Experts 0 and 1 (rank 0's) take every token; rank 1's experts receive none, all steps.
    ("collapsed_top2", FORCED, [100.0, 100.0] + [0.0] * 6, [0, 1]),
    # Top-1 to expert 7: one expert, on rank 1, receives every token.
    pytest.param("one_expert_top1", FORCED + ["moe.topk=1"], [0.0] * 7 + [100.0], [7], marks=pytest.mark.slow),
    # Every token to every expert.
    pytest.param("topk_all", [f"moe.topk={E}"], None, list(range(E)), marks=pytest.mark.slow),
])
def test_training_on_extreme_routing_matches_one_process(tmp_path, case, extra, bias, used):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    one_cfg = load_config("mixtral-tiny", SMALL + extra + [f"train.run_dir={tmp_path / 'one'}", cache])
    one = train(one_cfg, build_model=_biased_build(bias)) if bias is not None else train(one_cfg)
    initial = _initial_experts(one_cfg)
    two_cfg = load_config("mixtral-tiny", SMALL + extra + [f"train.run_dir={tmp_path / 'two'}", cache,
                                                           "parallel.ep=2"])
    two = run_ranks(_train_biased, 2, two_cfg, bias, timeout=240)

    ref, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        assert not b["skipped"] and math.isfinite(b["loss"]) and math.isfinite(b["grad_norm"])
        for key in ("loss", "lm_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), key
        assert b["expert_load"] == a["expert_load"]
        tokens = one_cfg.train.global_batch_size * one_cfg.model.seq_length
        for layer in b["expert_load"]:
            assert [e for e, n in enumerate(layer) if n] == used
            assert sum(layer) == tokens * one_cfg.moe.topk
    assert all(r.losses == pytest.approx(one.losses, rel=2e-5) for r in two)
    unused = [e for e in range(E) if e not in used]
    for run in ("one", "two"):
        final = _final_experts(tmp_path / run)
        assert set(final) == set(initial), run
        for name, start in initial.items():
            assert torch.isfinite(final[name]).all(), (run, name)
            assert torch.equal(final[name][unused], start[unused]), (run, name)  # no token, no grad, no step
            assert not torch.equal(final[name][used], start[used]), (run, name)
