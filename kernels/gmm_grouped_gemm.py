"""Grouped GEMM on the grouped-gemm package (CUTLASS/cuBLAS kernels; CUDA and bfloat16 only).

The package builds CUDA code and cannot be installed without CUDA, so it is imported only
when this backend is asked for."""

import torch

_INSTALL = "pip install 'moe-fold[gpu]' (the grouped_gemm package; needs CUDA to build)"


def gmm_grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """``counts``: int64 tensor [E] on the host, which is what the package reads."""
    try:
        from grouped_gemm import ops
    except ImportError as err:
        raise ImportError(f"gmm backend 'grouped_gemm' needs the grouped_gemm package: {_INSTALL}") from err
    if not x.is_cuda:
        raise RuntimeError(f"gmm backend 'grouped_gemm' runs on CUDA only, got x on {x.device}; {_INSTALL}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"gmm backend 'grouped_gemm' takes bfloat16, got x.dtype={x.dtype}")
    if x.shape[0] == 0:
        # Some builds of the package reject a batch with no rows at all; the product is then
        # empty and dw is zero, which the loop gives exactly with no kernel launched.
        from .gmm_loop import gmm_loop

        return gmm_loop(x, w, counts.tolist(), trans_b)
    return ops.gmm(x.contiguous(), w.contiguous(), counts, trans_b)


def gmm_grouped_gemm_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """The weight gradient of :func:`gmm_grouped_gemm`, as the package's own backward
    computes it (``trans_a`` over each group's rows); ``counts`` on the host."""
    from grouped_gemm import backend

    if x.shape[0] == 0:
        from .gmm_loop import gmm_loop_wgrad

        return gmm_loop_wgrad(x, dy, counts.tolist(), trans_b)
    lhs, rhs = (dy, x) if trans_b else (x, dy)
    return backend.gmm(lhs.contiguous(), rhs.contiguous(), counts, trans_a=True, trans_b=False)
