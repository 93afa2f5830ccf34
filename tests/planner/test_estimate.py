"""The layout planner's estimate (moe_fold/planner/estimate.py), by hand: zero experts across
parameters, FLOPs, bytes and memory; memory by kind; step time and MFU; the pipeline bubble;
and the search over layouts. Its parts: tests/planner/test_comm.py, test_model.py,
test_moe_overlap.py."""

from __future__ import annotations

import pytest

from moe_fold.config import load_config
from moe_fold.planner.comm import step_bytes
from moe_fold.planner.model import param_manifest

from tests.helpers.planner_cases import hand_config


# --------------------------------------------------------------------------- by hand

def test_zero_experts_by_hand():
    """Zero experts (4 beside the 4 held, top-2): the router scores 8 columns, and a token
    sends 2 * 4/8 = 1 row on average, so expert FLOPs, activated parameters, expert
    activation rows and the rows on the wire all halve."""
    from moe_fold.planner.estimate import model_params
    from moe_fold.planner.memory import held_row_bytes, layer_activation_bytes
    from moe_fold.planner.model import held_rows_per_token, layer_forward_flops

    config, plain = hand_config(), hand_config()
    config.moe.zero_experts = 4
    assert held_rows_per_token(config) == 1.0 and held_rows_per_token(plain) == 2.0
    # router 2*8*8 = 128, 1 expert row 6*8*6 = 288, shared as before
    assert layer_forward_flops(config, 1) == {"attention": 384, "core": 128, "mlp": 0.0, "router": 128,
                                              "experts": 288, "latent": 0.0, "shared": 208}
    # the router grows by 4*8 = 32 -> 1712; activated 1712 - 576 + 1/4 of the experts (144)
    assert model_params(config) == {"total": 1712, "experts": 576, "activated": 1280}
    # Activations: one expert row fewer (its kept bytes, 56 here, and the dispatcher's 16),
    # the router's 4 more columns (the top-k op's float32 logits and probs and bool map,
    # 9*4, the aux loss's float32 scores 4*4), and the zero experts' output's float32 gate
    # weight, 4 (the input it keeps, the norm output, the shared expert's gate keeps already).
    assert held_row_bytes(plain, "none") == 56
    assert layer_activation_bytes(config, 1, "none") == layer_activation_bytes(plain, 1, "none") - (56 + 16) + 52 + 4
    # ep 2: a token's one held row leaves for the other rank half the time: 1 row sent and
    # 1 received per rank (2 tokens), each way, of H*a = 16 bytes, probs 4 bytes each way.
    config = hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    config.moe.zero_experts = 4
    assert step_bytes(config, 4)["ep"] == 2 * 2 * 16 + 2 * 2 * 4 // 2
    # aux-loss statistics over every column: 2*8 + 1 float64 over tp x cp = 2 ranks
    assert step_bytes(config, 4)["tp_cp"] == 8 * (2 * 8 + 1)


def test_latent_moe_by_hand():
    """A latent MoE (latent 4 of hidden 8): the experts' rows and weights are 4 wide, so
    their FLOPs, parameters, kept row bytes and the rows on the wire halve; the two
    replicated projections add 2*8*4 weights, 4*8*4 FLOPs a token and keep the combined rows."""
    from moe_fold.planner.estimate import model_params
    from moe_fold.planner.memory import held_row_bytes, layer_activation_bytes
    from moe_fold.planner.model import layer_forward_flops

    config, plain = hand_config(), hand_config()
    config.moe.latent_size = 4
    # router 2*8*4 = 64, 2 expert rows 2*6*4*6 = 288 (hidden-wide: 576), projections 4*8*4 = 128
    assert layer_forward_flops(config, 1) == {"attention": 384, "core": 128, "mlp": 0.0, "router": 64,
                                              "experts": 288, "latent": 128, "shared": 208}
    # the experts shrink from 576 to 4*(4*12 + 6*4) = 288, the projections add 64; 2 of 4 experts active
    assert model_params(plain)["total"] == 1680
    assert model_params(config) == {"total": 1680 - 288 + 64, "experts": 288, "activated": 1456 - 288 + 144}
    names = [e.name for e in param_manifest(config)]
    assert "layers.1.mlp.latent_in.weight" in names and "layers.1.mlp.latent_out.weight" in names
    # A kept row: its input 2*4 (not 2*8), fc1 out + SwiGLU out 3*2*6, its prob 4.
    assert held_row_bytes(plain, "none") == 56 and held_row_bytes(config, "none") == 48
    # 2 rows of 8 bytes less, the combined latent rows 2*4 more (the norm output, which the
    # projection in reads, the shared expert's gate keeps already).
    assert layer_activation_bytes(config, 1, "none") == layer_activation_bytes(plain, 1, "none") - 2 * 8 + 8
    # ep 2: 2 tokens a rank, 4 rows, 2 sent and 2 received, each way, of L*a = 8 bytes (not
    # 16), probs 4 bytes each way.
    for c in (config, plain):
        c.parallel.tp, c.parallel.ep, c.parallel.etp, c.parallel.sequence_parallel = 2, 2, 1, True
    assert step_bytes(plain, 4)["ep"] == 2 * 4 * 16 + 4 * 4
    assert step_bytes(config, 4)["ep"] == 2 * 4 * 8 + 4 * 4


def test_memory_by_hand():
    from moe_fold.planner.estimate import Assumptions, _memory
    from moe_fold.planner.model import head_activation_bytes, layer_activation_bytes

    config = hand_config()
    # bf16 activations, a = 2. Attention per token: norm in 2*8 + qkv in 2*8 + q,k,v,out
    # 2*(2*8 + 2*4) + lse 4*2 heads + proj in 2*8 = 104; dense MLP: 16 + 16 + 3*2*12 = 104
    assert layer_activation_bytes(config, 0, "none") == 208
    # MoE: attention 104, norm in and out 32, router fp32 input 4*8 + logits/scores/probs 3*4*4 = 80,
    # 2 rows: inputs 2*2*8 = 32, fc1 out + SwiGLU out 2*3*2*6 = 72, shared 16 + 3*2*4 = 40, gated 16
    assert layer_activation_bytes(config, 1, "none") == 376
    # full recompute keeps the block input of a dense layer; of an MoE layer its attention
    # input, the norm, router and expert inputs and the gated shared output: 16+32+80+32+16
    assert layer_activation_bytes(config, 0, "full") == 16
    assert layer_activation_bytes(config, 1, "full") == 176
    # head: norm in 16 + head in 16 + logits (2 + 4) * 16
    assert head_activation_bytes(config) == 128

    # world 2: dp 2, edp 2, one micro-batch of 4 tokens each; Megatron's footprint
    memory = _memory(config, 2, 0, 1, Assumptions(memory_overhead=0, implementation="megatron"),
                     param_manifest(config))
    # the distributed optimizer shards the 12 bytes over dp (1104 dense) and edp (576 experts)
    assert memory == {"weights": 2 * 1680, "grads": 4 * 1680, "optimizer": 12 * 1680,
                      "activations": 4 * (208 + 376 + 128), "overhead": 0, "total": 18 * 1680 + 4 * 712,
                      "optimizer_not_distributed": 12 * 1680, "optimizer_distributed": 12 * (1104 / 2 + 576 / 2)}
    config.optimizer.distributed = True
    memory = _memory(config, 2, 0, 1, Assumptions(memory_overhead=0, implementation="megatron"),
                     param_manifest(config))
    assert memory["optimizer"] == 12 * (1104 / 2 + 576 / 2)
    assert memory["total"] == 6 * 1680 + 12 * (1104 / 2 + 576 / 2) + 4 * 712


def test_step_time_and_mfu_by_hand():
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU

    # world 2 in one node, dp 2 and edp 2: the only traffic is the gradient all-reduce.
    config = hand_config()
    gpu = GPU("toy", peak_flops=1e6, memory=1e9, hbm_bw=1e6, nvlink_bw=1e3, inter_node_bw=1e2)
    plan = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    # each rank: one micro-batch of 4 tokens, 3 * 2704 FLOPs each, at 0.5 * 1e6 FLOP/s
    compute = 4 * 3 * 2704 / 0.5e6
    # float32 grads all-reduced over 2 ranks send B each: the dense ones over dp_cp, the
    # experts over edp, 4 * 1680 bytes in all, at NVLink's 1e3 B/s (one node)
    grads = 4 * 1680 / 1e3
    optimizer = 1680 * 30 / 1e6
    assert plan.time["compute"] == pytest.approx(compute)
    # the config leaves both overlaps off: every byte is exposed, as moe-fold runs it
    assert plan.overlaps == [] and plan.overlap_model == "moe-fold"
    assert plan.time["dp_cp grads (exposed)"] + plan.time["edp grads (exposed)"] == pytest.approx(grads)
    assert plan.time["total"] == pytest.approx(compute + grads + optimizer)
    assert plan.mfu == pytest.approx(3 * 2704 * 8 / (2 * 1e6 * plan.time["total"]))
    # Megatron's overlap: hidden behind the backward (2/3 of the compute) except one bucket,
    # which here (2^24 elements) covers all of it: nothing changes
    megatron = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0, overlap="megatron"))
    assert megatron.overlaps == ["grad_reduce"]
    assert megatron.time["total"] == pytest.approx(plan.time["total"])
    # buckets of 64 elements: each group's reduction is hidden but for the part longer than
    # the backward window, at least one bucket (64 * 4 / 2 bytes over 2 ranks)
    config.parallel.overlap_grad_reduce = True
    config.parallel.grad_bucket_numel = 64
    small = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    assert small.overlaps == ["grad_reduce"]
    window = 2 / 3 * compute
    for kind in ("dp_cp", "edp"):
        full = plan.time[f"{kind} grads (exposed)"]
        assert small.time[f"{kind} grads (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - window))
    # the distributed optimizer: the same bytes, half of the time the parameter gather,
    # hidden behind the forward (1/3 of the compute) with parallel.overlap_param_gather
    config.optimizer.distributed = True
    config.parallel.overlap_param_gather = True
    zero = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    assert zero.overlaps == ["grad_reduce", "param_gather"]
    for kind in ("dp_cp", "edp"):
        full = plan.time[f"{kind} grads (exposed)"] / 2
        assert zero.time[f"{kind} grads (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - window))
        assert zero.time[f"{kind} params (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - compute / 3))


def test_bubble_and_in_flight():
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU
    from moe_fold.planner.model import microbatches_in_flight

    config = load_config("mixtral-tiny", ["parallel.pp=2", "parallel.ep=1", "train.global_batch_size=16",
                                          "train.micro_batch_size=4", "train.precision=bf16"])
    # 1F1B: stage r holds pp - r micro-batches; interleaved stage 0 with pp 2, vpp 2:
    # 2*(2-1) + (2-1)*2 + 1 = 5 chunk-forwards of half the stage = 2.5 micro-batches
    assert microbatches_in_flight(config, 0, 8) == 2
    assert microbatches_in_flight(config, 1, 8) == 1
    assert microbatches_in_flight(config, 0, 1) == 1
    config.parallel.vpp, config.parallel.pp_schedule = 2, "interleaved"
    assert microbatches_in_flight(config, 0, 8) == 2.5
    gpu = GPU("toy", peak_flops=1e9, memory=1e12, hbm_bw=1e12, nvlink_bw=1e15, inter_node_bw=1e15)
    plan = estimate(config, 2, gpu, Assumptions(matmul_efficiency=1.0))
    # 4 micro-batches (16 / (4 * dp 1)); bubble (pp - 1)/vpp = 1/2 of the slowest stage's micro-batch
    per_micro = plan.time["compute"] / 4 + plan.time.get("pp", 0) / 4
    assert plan.time["bubble"] == pytest.approx(per_micro / 2)


# --------------------------------------------------------------------------- search

def test_search_ranks_valid_fitting_layouts():
    from moe_fold.planner.estimate import estimate, search
    from moe_fold.planner.hardware import get_gpu

    config = load_config("mixtral-tiny", ["train.precision=bf16"])
    plans = search(config, 8, get_gpu("h100"))
    layouts = [tuple(p.layout[k] for k in ("tp", "cp", "pp", "vpp", "ep", "etp")) for p in plans]
    assert len(layouts) == len(set(layouts)) > 10
    assert all(p.fits for p in plans)
    assert [p.mfu for p in plans] == sorted((p.mfu for p in plans), reverse=True)
    # every candidate's numbers are what estimate gives for that layout
    best = plans[0]
    from moe_fold.planner.estimate import with_layout
    lay = best.layout
    again = estimate(with_layout(config, tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], vpp=lay["vpp"], ep=lay["ep"],
                                 etp=lay["etp"]), 8, get_gpu("h100"))
    assert again.mfu == best.mfu
