"""The Triton grouped GEMM (kernels/gmm_triton.py) on a CPU: without the Triton interpreter it
refuses to run. Its results on a GPU and under the interpreter: tests/kernels/test_gmm.py and
tests/kernels/test_gpu_kernels.py."""

import pytest
import torch

from moe_fold.kernels.gmm import gmm


def test_triton_without_interpreter_on_cpu_raises(monkeypatch):
    from moe_fold.kernels import gmm_triton

    monkeypatch.setattr(gmm_triton, "_INTERPRET", False)  # as if TRITON_INTERPRET were unset at import
    with pytest.raises(RuntimeError, match="'triton' needs CUDA tensors .* or TRITON_INTERPRET=1"):
        gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3], backend="triton")
