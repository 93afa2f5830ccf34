import os
import sys

# This process runs on the CPU (Triton interpreted, CUDA hidden: a GPU host gives CI's
# results) or, with MOE_FOLD_TESTS_ON_GPU=1, runs the gpu-marked tests only (Triton
# compiled): tests/helpers/gpu_support.py. Set before torch and triton are imported.
from tests.helpers import gpu_support  # noqa: E402

gpu_support.pin_process(os.environ)
# Idle OpenMP workers that spin while they wait starve the busy thread on a small shared
# CPU; must be set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread in the test process by default: multi-rank tests run their ranks beside it
# (one thread each), and tiny single-process references gain nothing from a second thread.
# MOE_FOLD_TEST_THREADS=2 runs the suite with two, so comparisons are checked against the
# other summation orders a multi-threaded kernel takes.
torch.set_num_threads(int(os.environ.get("MOE_FOLD_TEST_THREADS", "1")))

_GPU_CHILD: "gpu_support.GpuChild | None" = None
_RECORDER: "gpu_support.OutcomeRecorder | None" = None


def pytest_configure(config):
    global _RECORDER
    if gpu_support.on_gpu_process() and os.environ.get(gpu_support.REPORT_ENV):
        _RECORDER = gpu_support.OutcomeRecorder(os.environ[gpu_support.REPORT_ENV])


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the gpu child runs the selected ones only
def pytest_collection_modifyitems(config, items):
    """gpu tests: skipped with the reason where the host has no usable CUDA; else run by
    this process (the GPU one) or by its gpu child (the CPU one). The GPU process runs
    nothing else."""
    global _GPU_CHILD
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_support.on_gpu_process():
        others = [item for item in items if not item.get_closest_marker("gpu")]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = gpu
    if not gpu:
        return
    reason = gpu_support.host_cuda_missing_reason()
    if reason is not None:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))
    elif not gpu_support.on_gpu_process():
        _GPU_CHILD = gpu_support.GpuChild([item.nodeid for item in gpu])
        for item in gpu:  # the first one reached waits for the whole child run
            item.add_marker(pytest.mark.timeout(gpu_support.CHILD_TIMEOUT_S))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """In the CPU process, a gpu test reports its outcome in the gpu child."""
    if _GPU_CHILD is None or not pyfuncitem.get_closest_marker("gpu"):
        return None
    gpu_support.report(_GPU_CHILD.outcome(pyfuncitem.nodeid))
    return True


def pytest_runtest_logreport(report):
    if _RECORDER is not None:
        _RECORDER.add(report)


def pytest_sessionfinish(session):
    if _RECORDER is not None:
        _RECORDER.write()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """A data cache shared by the tests of one module (the demo corpus is tokenized once)."""
    return str(tmp_path_factory.mktemp("data_cache"))
