"""bench/moe_layer.py: its Megatron-Core-style candidate is the same layer as ours (output
and every gradient, on one process and on ep ranks), and the script's ep lines say what
its docstring says. Timings are not asserted."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups

from tests.helpers.paths import REPO

BENCH = str(REPO / "bench" / "moe_layer.py")
SHAPE = dict(tokens=40, hidden=16, ffn=24, experts=8, topk=2)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe_layer", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grads(layer, x, grad):
    """Output and the grads of the input, the router and the experts' weights, the latter
    as ``[E_local, in, out]`` whatever the layer's own layout."""
    out = layer(x)
    params = [x] + list(layer.parameters())
    grads = torch.autograd.grad(out, params, grad)
    gx, g_router, rest = grads[0], grads[1], grads[2:]
    if len(rest) == 2:  # ours: fc1 [E, H, 2F], fc2 [E, F, H]
        fc1, fc2 = rest
    else:  # Megatron-style: per-expert [2F, H] then per-expert [H, F]
        half = len(rest) // 2
        fc1 = torch.stack([w.t() for w in rest[:half]])
        fc2 = torch.stack([w.t() for w in rest[half:]])
    return out.detach(), gx, g_router, fc1, fc2


def _compare(bench, groups, seed):
    ours = bench.build_ours(SHAPE, groups=groups)
    megatron = bench.MegatronStyleMoE(ours, None if groups is None else groups.ep)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE["tokens"], SHAPE["hidden"], generator=g).requires_grad_()
    grad = torch.randn(SHAPE["tokens"], SHAPE["hidden"], generator=g)
    for a, b in zip(_grads(ours, x, grad), _grads(megatron, x, grad)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_megatron_style_layer_is_ours_on_one_process():
    _compare(_load_bench(), None, seed=0)


def _ep_rank(rank, world_size):
    groups = create_process_groups(ParallelLayout(world_size, ep=world_size))
    _compare(_load_bench(), groups, seed=1 + rank)


def test_megatron_style_layer_is_ours_on_ep_ranks():
    run_ranks(_ep_rank, 4, timeout=240)


@pytest.mark.slow
def test_script_times_every_candidate_at_each_ep():
    """As a user runs it: ep 1 in this process, ep 2 on spawned gloo ranks."""
    shape = "x".join(str(SHAPE[k]) for k in ("tokens", "hidden", "ffn", "experts", "topk"))
    run = subprocess.run([sys.executable, BENCH, "--shapes", shape, "--ep", "1,2", "--rounds", "1", "--iters", "1",
                          "--hf-memory-gib", "0.001", "--timeout", "120"],
                         capture_output=True, text=True, timeout=400, check=True)
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    full = [r for r in lines if "skipped" not in r and r.get("ep") is not None]
    assert [r["ep"] for r in full] == [1, 2]
    one, two = full
    assert {"ours", "megatron", "hf:eager", "dense"} <= set(one["ms"])
    # The ratio comes from the unrounded times, the printed ms are rounded to 3 decimals.
    assert one["ratio_vs_megatron"] == pytest.approx(one["ms"]["megatron"] / one["ms"]["ours"], abs=2e-3)
    assert one["fastest"] in one["ms"] and not one["fastest"].startswith("gemm:")
    assert set(two["ms"]) == {"ours", "megatron"} and two["threads_per_rank"] >= 1
    assert two["ratio_vs_megatron"] == pytest.approx(two["ms"]["megatron"] / two["ms"]["ours"], abs=2e-3)
    assert two["max_abs_diff_vs_megatron"] < 1e-5
