"""The planner's shape model of compute time, its fit on published measurements, and the
held-out error it reaches (bench/published, bench/plan_validation.py, docs/planner.md)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench import plan_validation


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


def test_calibrated_assumptions():
    from moe_fold.planner.estimate import CALIBRATED_EFFICIENCY, calibrated

    a = calibrated("H100", overlap="megatron")
    assert a.compute_model == "shapes" and a.matmul_efficiency == CALIBRATED_EFFICIENCY["h100"]
    assert a.overlap == "megatron" and calibrated("h200").matmul_efficiency == CALIBRATED_EFFICIENCY["h100"]
    with pytest.raises(ValueError, match="no calibrated efficiency"):
        calibrated("tpu")
    assert math.isclose(dataclasses.replace(a, matmul_efficiency=0.6).matmul_efficiency, 0.6)
