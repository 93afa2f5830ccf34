"""How the suite splits between the CPU and the GPU (tests/helpers/gpu_support.py, conftest.py)
and bench/gpu_smoke.py where there is no GPU: checked on this CPU host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import gpu_support

from tests.helpers.paths import REPO as ROOT
GPU_TEST = "tests/training/test_wait_timer.py::test_cuda_waits_are_timed_on_the_stream_not_the_host"


def test_this_process_is_pinned_to_the_cpu():
    """What a GPU host must not change: no CUDA device and the Triton interpreter here,
    and the same for every process a test starts."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["TRITON_INTERPRET"] == "1"
    assert not torch.cuda.is_available() and not gpu_support.on_gpu_process()
    child = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                           capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "''"


def test_pin_process_and_the_gpu_child_environment():
    cpu = {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin"}
    gpu_support.pin_process(cpu)
    assert cpu == {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PATH": "/bin",
                   gpu_support.HOST_DEVICES_ENV: "2,3"}
    child = gpu_support.host_environ(cpu)
    assert child == {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin", gpu_support.ON_GPU_ENV: "1"}
    gpu_support.pin_process(child)  # the child's own conftest: compiled kernels
    assert "TRITON_INTERPRET" not in child and child["CUDA_VISIBLE_DEVICES"] == "2,3"
    unset = {"TRITON_INTERPRET": "0"}  # a user's choice of interpreter is kept on the CPU side
    gpu_support.pin_process(unset)
    assert unset["TRITON_INTERPRET"] == "0" and "CUDA_VISIBLE_DEVICES" not in gpu_support.host_environ(unset)


def test_reasons_to_skip_name_the_cause():
    assert gpu_support.cuda_missing_reason("2.13.0", "12.8", 1) is None
    assert "torch 2.13.0+cpu is a CPU-only build" in gpu_support.cuda_missing_reason("2.13.0+cpu", None, 0)
    assert "torch.cuda.is_available() is False (torch 2.13.0, CUDA 12.8, no GPU visible)" in \
        gpu_support.cuda_missing_reason("2.13.0", "12.8", 0)


def test_gpu_tests_skip_here_with_the_reason():
    """The gpu child machinery end to end: a child pytest on the GPU side (MOE_FOLD_TESTS_ON_GPU=1,
    interpreter off) runs the gpu test and reports its outcome: here, skipped for want of CUDA."""
    child = gpu_support.GpuChild([GPU_TEST])
    got = child.outcome(GPU_TEST)
    assert got == {"outcome": "skipped", "text": gpu_support.host_cuda_missing_reason()}
    assert "needs CUDA" in got["text"]
    assert child.outcome("tests/test_x.py::nothing")["outcome"] == "failed"


def test_the_childs_outcome_becomes_the_tests():
    gpu_support.report({"outcome": "passed", "text": ""})
    with pytest.raises(pytest.skip.Exception, match="needs CUDA: x"):
        gpu_support.report({"outcome": "skipped", "text": "needs CUDA: x"})
    for outcome in ("failed", "error"):
        with pytest.raises(pytest.fail.Exception, match="failed on the GPU .*\n1 != 2"):
            gpu_support.report({"outcome": outcome, "text": "1 != 2"})


def _report(nodeid, when, outcome, longrepr=None):
    return SimpleNamespace(nodeid=nodeid, when=when, failed=outcome == "failed", skipped=outcome == "skipped",
                           longrepr=longrepr, longreprtext=str(longrepr))


def test_outcome_recorder_keeps_a_failure_over_later_phases(tmp_path):
    recorder = gpu_support.OutcomeRecorder(str(tmp_path / "r.json"))
    for r in [_report("a", "setup", "passed"), _report("a", "call", "passed"), _report("a", "teardown", "passed"),
              _report("b", "setup", "skipped", ("f.py", 1, "Skipped: needs CUDA: x")),
              _report("c", "call", "failed", "AssertionError: 1 != 2"), _report("c", "teardown", "passed"),
              _report("d", "call", "passed"), _report("d", "teardown", "failed", "leak")]:
        recorder.add(r)
    recorder.write()
    import json

    got = json.loads((tmp_path / "r.json").read_text())
    assert {k: v["outcome"] for k, v in got.items()} == {"a": "passed", "b": "skipped", "c": "failed", "d": "failed"}
    assert got["b"]["text"] == "needs CUDA: x" and "1 != 2" in got["c"]["text"] and "[teardown] leak" in got["d"]["text"]


def test_gpu_smoke_says_there_is_no_gpu_and_fails():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_smoke"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""  # no table, nothing pretended
    assert proc.stderr.startswith("gpu_smoke: no CUDA device here, nothing was run: needs CUDA: ")


def test_gpu_smoke_groups_outcomes_per_test_function():
    from bench.gpu_smoke import group_outcomes, render

    outcomes = {"tests/kernels/test_gpu_kernels.py::test_gmm[fp32-False-triton]": {"outcome": "passed"},
                "tests/kernels/test_gpu_kernels.py::test_gmm[bf16-False-grouped_gemm]": {"outcome": "skipped"},
                "tests/kernels/test_gpu_kernels.py::test_gmm[bf16-True-torch]": {"outcome": "failed"},
                "tests/training/test_gpu_train.py::test_bf16_train": {"outcome": "passed"}}
    assert group_outcomes(outcomes) == {"test_gpu_kernels::test_gmm": {"passed": 1, "failed": 1, "skipped": 1},
                                        "test_gpu_train::test_bf16_train": {"passed": 1, "failed": 0, "skipped": 0}}
    assert render([("device", "H100"), ("versions", "torch")]).splitlines() == [
        "| row      | result |", "|----------|--------|", "| device   | H100 |", "| versions | torch |"]
