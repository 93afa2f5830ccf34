"""The planner's shape model of compute time, its fit on published measurements, and the
held-out error it reaches (bench/published, bench/plan_validation.py, docs/planner.md)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

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


@pytest.fixture(scope="module")
def validation():
    rows = plan_validation.read_rows()
    results = {r["id"]: plan_validation.predict(r) for r in rows}
    return rows, results, plan_validation.summary(list(results.values()))


def test_published_rows_are_sourced_and_held_out_error_is_small(validation):
    """Error by GPU generation, held-out rows apart from calibration rows: each generation
    has its own fitted efficiency, so a pooled median would hide one behind another."""
    rows, results, summary = validation
    assert len(rows) >= 12 and len({r["source"] for r in rows}) >= 3
    for r in rows:
        assert len(r["source_ref"]) > 40 and float(r["published"]) > 0, r["id"]
        assert r["calibration"] in ("yes", "no") and r["metric"] in plan_validation.METRICS
    assert len({r["id"] for r in rows}) == len(rows)
    by_gpu = summary["by_gpu"]
    assert set(by_gpu) == {"v100", "a100", "h100"}
    assert by_gpu["h100"]["held_out"]["rows"] >= 20 and by_gpu["h100"]["held_out"]["median_abs_error"] <= 0.08
    assert by_gpu["a100"]["held_out"]["rows"] >= 6 and by_gpu["a100"]["held_out"]["median_abs_error"] <= 0.10
    assert by_gpu["v100"]["held_out"]["rows"] >= 2 and by_gpu["v100"]["held_out"]["median_abs_error"] <= 0.10
    # the calibration rows stay within 10% of their own fit (several rows share one efficiency)
    assert all(abs(r["error"]) < 0.10 for r in results.values() if r["fit"])
    # the flat model the planner had before misses the held-out rows by far more
    flat = plan_validation.summary([plan_validation.predict(r, {"flat": 0.7}) for r in rows])
    assert flat["held_out_median_abs_error"] > 2 * summary["held_out_median_abs_error"]


def test_h100_time_model_meets_the_published_rows(validation):
    """Every row of the MoE Parallel Folding paper's Table 3 is held out and within 10%; the
    H100 efficiency is fitted on at least 3 rows, none from Table 3; the fine-grained MoE
    rows (Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3) are within 20%."""
    rows, results, _ = validation
    table3 = [r for r in rows if "Table 3 (" in r["source_ref"]]
    assert len(table3) == 4
    for r in table3:
        assert r["calibration"] == "no", r["id"]
        assert abs(results[r["id"]]["error"]) <= 0.10, (r["id"], results[r["id"]]["error"])
    calibration = [r for r in rows if r["gpu"] == "h100" and r["calibration"] == "yes"]
    assert len(calibration) >= 3 and not any("Table 3 (" in r["source_ref"] for r in calibration)
    fine = [r for r in rows if r["config"] in ("qwen3-30b-a3b", "deepseek-v3")]
    assert {r["config"] for r in fine} == {"qwen3-30b-a3b", "deepseek-v3"} and len(fine) >= 3
    for r in fine:
        assert r["calibration"] == "no" and abs(results[r["id"]]["error"]) <= 0.20, (r["id"], results[r["id"]]["error"])


def test_plan_command_and_validation_print_one_mfu(capsys, validation):
    """``moe-fold plan --row`` and the same row spelled out as flags give the MFU that
    bench/plan_validation.py predicts (both call moe_fold.planner.precedent.row_plan's
    inputs); the preset's own defaults differ from the paper's run and give another."""
    import json

    from moe_fold.cli import main

    _, results, _ = validation
    row_id = "liu25-mixtral-8x22b-folding"
    want = results[row_id]["predicted_mfu"]

    def mfu(argv):
        assert main(["plan", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["mfu"]

    assert mfu(["--row", row_id]) == pytest.approx(want, rel=1e-9)
    spelled = ["--config", "mixtral-8x22b", "--world", "128", "--gpu", "h100", "--tp", "2", "--pp", "8", "--vpp", "7",
               "--ep", "8", "--etp", "1", "--cp", "1", "--mbs", "1", "--gbs", "256", "--seq", "4096", "--recompute", "none",
               "--distributed-optimizer", "--overlap", "megatron", "--implementation", "megatron",
               "--set", "moe.capacity_factor=1.0"]
    assert mfu(spelled) == pytest.approx(want, rel=1e-9)
    # the layout alone keeps the preset's recompute (moe), optimizer and overlap switches
    assert mfu(["--config", "mixtral-8x22b", "--world", "128", "--tp", "2", "--pp", "8", "--vpp", "7", "--ep", "8",
                "--etp", "1"]) < 0.9 * want
    # a flag given with --row overrides the row's setting
    assert mfu(["--row", row_id, "--overlap", "none"]) < want
    assert main(["plan", "--row", "no-such-row"]) == 2
    assert "no-such-row" in capsys.readouterr().err
    assert main(["plan", "--row", row_id, "--config", "mixtral-8x7b"]) == 2
    assert main(["plan", "--config", "mixtral-8x22b"]) == 2
    assert "--config and --world are required" in capsys.readouterr().err


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
    assert fitted["gemm_k_overhead"] == CALIBRATED["gemm_k_overhead"]
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
