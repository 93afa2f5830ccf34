"""The planner's shape model of compute time, its fit on published measurements, and the
held-out error it reaches (bench/published, bench/plan_validation.py, docs/planner.md)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from bench import plan_validation


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
    gpu = GPU("toy", peak_flops=1e12, memory=1e12, hbm_bw=1e15, nvlink_bw=1e9, inter_node_bw=1e9)
    got = microbatch_compute(config, 0, "none", gpu, 0.5, 10.0)
    t, h, f = 1024, 256, 512
    gemm = 3 * 2 * t * (h * 3 * h + h * h + h * 2 * f + f * h) / 0.5e12  # qkv, proj, fc1, fc2; x3 fwd+bwd
    core = 3 * 0.5 * 2 * t * 1024 * 2 * (128 + 128) / 0.5e12  # causal half of the counted products
    elementwise = 3 * (10 * 2 * h * t + 3 * 2 * f * t) / 1e15
    assert got["gemm"] == pytest.approx(gemm) and got["attention"] == pytest.approx(core)
    assert got["elementwise"] == pytest.approx(elementwise) and got["experts"] == 0
    # full recompute reruns the forward GEMMs, the core and the element-wise work once more
    full = microbatch_compute(config, 0, "full", gpu, 0.5, 10.0)
    assert full["gemm"] == pytest.approx(gemm * 4 / 3) and full["elementwise"] == pytest.approx(elementwise * 4 / 3)


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


def test_published_rows_are_sourced_and_held_out_error_is_small():
    rows = plan_validation.read_rows()
    assert len(rows) >= 12 and len({r["source"] for r in rows}) >= 3
    for r in rows:
        assert len(r["source_ref"]) > 40 and float(r["published"]) > 0, r["id"]
        assert r["calibration"] in ("yes", "no") and r["metric"] in plan_validation.METRICS
    assert len({r["id"] for r in rows}) == len(rows)
    results = [plan_validation.predict(r) for r in rows]
    summary = plan_validation.summary(results)
    assert summary["held_out_rows"] >= 12
    assert summary["held_out_median_abs_error"] <= 0.10
    # the calibration rows are reproduced by their own fit (within 1%)
    assert all(abs(r["error"]) < 0.01 for r in results if r["fit"])
    # the flat model the planner had before misses the held-out rows by far more
    flat = plan_validation.summary([plan_validation.predict(r, {"flat": 0.7}) for r in rows])
    assert flat["held_out_median_abs_error"] > 2 * summary["held_out_median_abs_error"]


def test_mfu_rows_predict_the_model_flops_share_of_the_peak():
    """The MoE Parallel Folding rows publish MFU in percent: the prediction is the same
    step's model TFLOP/s over the GPU's peak, and both headline rows are held out with the
    layout the paper's Table 3 gives."""
    from moe_fold.planner.hardware import get_gpu

    rows = {r["id"]: r for r in plan_validation.read_rows()}
    for name, layout, mfu in (("liu25-mixtral-8x22b-folding", ("128", "2", "8", "8", "1", "1"), 49.3),
                              ("liu25-qwen2-57b-a14b-folding", ("64", "2", "4", "4", "1", "1"), 39.0)):
        row = rows[name]
        assert (row["world"], row["tp"], row["pp"], row["ep"], row["etp"], row["cp"]) == layout
        assert float(row["published"]) == mfu and row["calibration"] == "no" and "Table 3" in row["source_ref"]
        got = plan_validation.predict(row)
        as_tflops = plan_validation.predict(dict(row, metric="model_tflops", published=str(mfu * 9.89)))
        assert got["predicted"] == pytest.approx(as_tflops["predicted"] / (get_gpu("h100").peak_flops / 1e14), rel=1e-3)
        assert got["predicted_mfu"] == pytest.approx(got["predicted"] / 100, rel=1e-3)
        assert got["published_mfu"] == pytest.approx(mfu / 100)
        assert got["error"] == pytest.approx(as_tflops["error"], abs=2e-3)


@pytest.mark.slow
def test_shipped_figures_are_the_fit_on_the_calibration_rows_only():
    """CALIBRATED is what the fit gives when it sees the calibration rows and nothing else
    (the held-out rows cannot have shaped it)."""
    from moe_fold.planner.estimate import CALIBRATED, FITTED_EFFICIENCY

    rows = [r for r in plan_validation.read_rows() if r["calibration"] == "yes"]
    assert {r["gpu"] for r in rows} == set(FITTED_EFFICIENCY)
    fitted = plan_validation.fit(rows)
    assert fitted["elementwise_passes"] == CALIBRATED["elementwise_passes"]
    for gpu, e in FITTED_EFFICIENCY.items():
        assert fitted["efficiency"][gpu] == pytest.approx(e, abs=0.002), gpu


def test_closest_precedent_names_a_published_row():
    from moe_fold.config import load_config
    from moe_fold.planner.estimate import calibrated, estimate
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.precedent import closest, read_published

    rows = read_published()
    moe = estimate(load_config("mixtral-8x7b", ["parallel.tp=1", "parallel.pp=4", "parallel.ep=8"]), 64,
                   get_gpu("h100"), calibrated("h100"))
    assert closest(rows, moe, "h100")["id"] == "mcore08-mixtral-8x7b"
    dense = plan_validation.row_config(next(r for r in rows if r["id"] == "narayanan21-145.6b"))
    plan = estimate(dense, 1536, get_gpu("a100"), calibrated("a100"))
    assert closest(rows, plan, "a100")["id"] == "narayanan21-145.6b"
    assert closest([], plan, "a100") is None
    with pytest.raises(ValueError, match="not a folder"):
        read_published("/nonexistent/published")


def test_calibrated_assumptions():
    from moe_fold.planner.estimate import CALIBRATED_EFFICIENCY, calibrated

    a = calibrated("H100", overlap="megatron")
    assert a.compute_model == "shapes" and a.matmul_efficiency == CALIBRATED_EFFICIENCY["h100"]
    assert a.overlap == "megatron" and calibrated("h200").matmul_efficiency == CALIBRATED_EFFICIENCY["h100"]
    with pytest.raises(ValueError, match="no calibrated efficiency"):
        calibrated("tpu")
    assert math.isclose(dataclasses.replace(a, matmul_efficiency=0.6).matmul_efficiency, 0.6)
