"""The grouped_gemm package backend (kernels/gmm_grouped_gemm.py): against the loop on CUDA, CPU
tensors refused, and a missing package named with how to install it."""

import sys

import pytest
import torch

from moe_fold.kernels.gmm import gmm

from tests.kernels.test_gmm import CASES, HAS_GROUPED_GEMM, _check


@pytest.mark.skipif(not HAS_GROUPED_GEMM, reason="grouped_gemm package not installed or no CUDA (pip install 'moe-fold[gpu]')")
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("counts,k,m", CASES)
def test_grouped_gemm(counts, k, m, trans_b):
    _check("grouped_gemm", counts, k, m, trans_b, torch.bfloat16)
    _check("grouped_gemm", counts, k, m, trans_b, torch.bfloat16, with_bias=True)


def test_grouped_gemm_missing_says_how_to_install(monkeypatch):
    from moe_fold.kernels import backends

    monkeypatch.setitem(sys.modules, "grouped_gemm", None)  # makes the import fail, installed or not
    backends._probe.cache_clear()
    try:
        with pytest.raises(backends.BackendUnavailable,
                           match=r"import grouped_gemm failed.*pip install 'moe-fold\[gpu\]'"):
            gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3], backend="grouped_gemm")
    finally:
        backends._probe.cache_clear()


@pytest.mark.skipif(not HAS_GROUPED_GEMM, reason="grouped_gemm package not installed or no CUDA (pip install 'moe-fold[gpu]')")
def test_grouped_gemm_rejects_cpu_tensors():
    with pytest.raises(RuntimeError, match="runs on CUDA only"):
        gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3], backend="grouped_gemm")
