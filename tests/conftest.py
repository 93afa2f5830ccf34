import os
import sys

# Tests import helpers from this folder and keep the Triton kernels on the CPU
# interpreter: the suite runs where there is no GPU.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRITON_INTERPRET", "1")
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



@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """A data cache shared by the tests of one module (the demo corpus is tokenized once)."""
    return str(tmp_path_factory.mktemp("data_cache"))
