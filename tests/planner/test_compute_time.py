"""The planner's compute time (moe_fold/planner/compute_time.py): the GEMM roofline with tile
quantization and the k0 term, the shape model's parts by hand (GEMMs, flash attention at its
forward and backward shares, element-wise passes, recompute), and busier expert rows."""

import dataclasses

import pytest


def test_gemm_seconds_by_hand():
    from moe_fold.planner.compute_time import gemm_seconds

    # aligned and large: compute bound, 2mkn at peak x efficiency
    assert gemm_seconds(1024, 512, 256, 1e12, 0.5, 1e15, 2, 2) == pytest.approx(2 * 1024 * 512 * 256 / 0.5e12)
    # 200 rows run as 256: the output tiles are 200/256 full
    assert gemm_seconds(200, 512, 256, 1e12, 0.5, 1e15, 2, 2) == pytest.approx(
        2 * 200 * 512 * 256 / (0.5e12 * 200 / 256))
    # a thin GEMM on a slow memory: bound by the bytes it reads and writes
    assert gemm_seconds(8, 4096, 4096, 1e12, 1.0, 1e9, 2, 2) == pytest.approx(
        2 * (8 * 4096 + 4096 * 4096 + 8 * 4096) / 1e9)
    assert gemm_seconds(0, 4096, 4096, 1e12, 1.0, 1e9, 2, 2) == 0.0
    # a tile's prologue and epilogue cost k0 of the reduction: k = 512 with k0 = 256 runs 1.5x
    assert gemm_seconds(1024, 512, 256, 1e12, 0.5, 1e15, 2, 2, k_overhead=256) == pytest.approx(
        1.5 * 2 * 1024 * 512 * 256 / 0.5e12)


def test_shape_model_parts_by_hand():
    """One dense layer (no head: pp 2, stage 0), tp 1, flash attention: its GEMMs, core and
    element-wise passes add up as compute_time's doc says."""
    from moe_fold.config import load_config
    from moe_fold.planner.compute_time import microbatch_compute
    from moe_fold.planner.hardware import GPU

    config = load_config("mixtral-tiny", ["model.hidden_size=256", "model.num_layers=2", "model.num_heads=2",
                                          "model.num_kv_heads=2", "model.head_dim=128", "model.ffn_hidden_size=512",
                                          "model.seq_length=1024", "moe.moe_layer_freq=0", "moe.num_experts=0",
                                          "parallel.pp=2", "train.micro_batch_size=1", "train.precision=bf16"])
    gpu = GPU("toy", peak_flops=1e12, memory=1e12, hbm_bw=1e15, nvlink_bw=1e9, inter_node_bw=1e9,
              flash_forward=0.6, flash_backward=0.3)
    got = microbatch_compute(config, 0, "none", gpu, 0.5, 10.0)
    t, h, f = 1024, 256, 512
    gemm = 3 * 2 * t * (h * 3 * h + h * h + h * 2 * f + f * h) / 0.5e12  # qkv, proj, fc1, fc2; x3 fwd+bwd
    causal = 0.5 * 2 * t * 1024 * 2 * (128 + 128)  # the causal half of the counted products
    core = causal / 0.6e12 + 2 * causal / 0.3e12  # forward at flash_forward, backward's two at flash_backward
    elementwise = 3 * (10 * 2 * h * t + 3 * 2 * f * t) / 1e15
    assert got["gemm"] == pytest.approx(gemm) and got["attention"] == pytest.approx(core)
    assert got["elementwise"] == pytest.approx(elementwise) and got["experts"] == 0
    # full recompute reruns the forward GEMMs, the core and the element-wise work once more
    full = microbatch_compute(config, 0, "full", gpu, 0.5, 10.0)
    assert full["gemm"] == pytest.approx(gemm * 4 / 3) and full["elementwise"] == pytest.approx(elementwise * 4 / 3)
    assert full["attention"] == pytest.approx(core + causal / 0.6e12)
    # k0 scales each GEMM by (k + k0)/k over its own reduction: the forward's k, the input
    # gradient's n, the weight gradient's t
    k0 = microbatch_compute(config, 0, "none", gpu, 0.5, 10.0, k_overhead=128)
    by_hand = sum(2 * t * k * n / 0.5e12 * ((k + 128) / k + (n + 128) / n + (t + 128) / t)
                  for k, n in ((h, 3 * h), (h, h), (h, 2 * f), (f, h)))
    assert k0["gemm"] == pytest.approx(by_hand)
    # a GPU without a flash kernel cannot plan flash attention
    with pytest.raises(ValueError, match="needs a flash attention kernel"):
        microbatch_compute(config, 0, "none", dataclasses.replace(gpu, flash_forward=0.0), 0.5, 10.0)


def test_busier_expert_rows_cost_more_expert_time():
    from moe_fold.config import load_config
    from moe_fold.planner.compute_time import microbatch_compute
    from moe_fold.planner.hardware import get_gpu

    config = load_config("mixtral-8x7b", ["parallel.tp=1", "parallel.pp=1", "parallel.ep=8"])
    gpu = get_gpu("h100")
    one = microbatch_compute(config, 0, "none", gpu, 0.5, 30.0)
    two = microbatch_compute(config, 0, "none", gpu, 0.5, 30.0, expert_rows=[2.0] * 32)
    # 1024 rows per expert, tile aligned and compute bound: twice the rows, twice the time
    assert two["experts"] == pytest.approx(2 * one["experts"], rel=1e-6)
    assert two["gemm"] == one["gemm"] and two["attention"] == one["attention"]
    with pytest.raises(ValueError, match="expert_rows has 3 entries"):
        microbatch_compute(config, 0, "none", gpu, 0.5, 30.0, expert_rows=[1.0] * 3)


def test_latent_experts_cost_their_width():
    """A latent MoE (experts in 2048 of Mixtral-8x7B's 4096 columns): the expert GEMMs,
    compute bound and tile aligned, take half the time; the two projections, H x L and
    L x H once per token forward and twice backward, add their own GEMM time."""
    from moe_fold.config import load_config
    from moe_fold.planner.compute_time import microbatch_compute
    from moe_fold.planner.hardware import get_gpu

    sets = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=8"]
    gpu = get_gpu("h100")
    hidden = microbatch_compute(load_config("mixtral-8x7b", sets), 0, "none", gpu, 0.5, 30.0)
    config = load_config("mixtral-8x7b", sets + ["moe.latent_size=2048"])
    latent = microbatch_compute(config, 0, "none", gpu, 0.5, 30.0)
    assert latent["experts"] == pytest.approx(hidden["experts"] / 2, rel=1e-6)
    tokens = config.train.micro_batch_size * config.model.seq_length
    projections = config.model.num_layers * 2 * 3 * 2 * tokens * 4096 * 2048 / (0.5 * gpu.peak_flops)
    assert latent["gemm"] - hidden["gemm"] == pytest.approx(projections, rel=1e-6)
