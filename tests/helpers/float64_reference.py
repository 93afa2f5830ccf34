"""Test helper: compare a float32 result with a reference computed in float64.

Two float32 computations of the same sum in different orders (a grouped GEMM and a
per-row loop, MKL's AVX-512 and AVX2 kernels, one thread and two) differ by rounding that
scales with the size of the *summands*, not of the result: an element formed by
cancellation can be tiny while its rounding error is that of the large terms. So a
float32-vs-float32 comparison with an absolute tolerance passes on one CPU and fails on
another. Against the float64 reference, the float32 result is compared with an absolute
tolerance scaled to the tensor's largest magnitude (the scale of the terms that every
element of it sums), plus the usual relative tolerance.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


def assert_close_to_float64(got: torch.Tensor, want: torch.Tensor, *, rtol: float = 1e-5,
                            atol: float = 1e-6, msg: str = "") -> None:
    """``got`` (float32) against ``want`` (computed in float64 from the same inputs):
    ``|got - want| <= atol * max(1, max|want|) + rtol * |want|`` elementwise."""
    assert want.dtype == torch.float64, f"the reference must be float64, got {want.dtype}"
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * scale,
                               msg=(lambda m: f"{msg}\n{m}" if msg else m))


class Float64Everywhere(TorchDispatchMode):
    """Inside this mode every float32 tensor an op reads, and every float32 dtype it is
    asked for, is float64: a model's forward runs wholly in float64 even where its code
    casts to float32 (``x.float()`` before a norm, a softmax in float32, transformers'
    delta rule and gated norm cast to float32). Two implementations of the same network,
    their weights cast to float64, then agree to float64's rounding, whatever float32 does
    on this CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def widen(x):
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                return x.double()
            return torch.float64 if x is torch.float32 else x
        return func(*tree_map(widen, args), **tree_map(widen, kwargs or {}))
