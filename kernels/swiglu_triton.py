"""Triton kernels of ``swiglu.py``: forward, and a backward that recomputes silu.

One program per row in the backward so the prob gradient (a reduction over F) is
written by a single program, without atomics.
"""
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(x_ptr, probs_ptr, out_ptr, F, stride_x, stride_out,
                       HAS_PROBS: tl.constexpr, ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < F
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(ACC)
    up = tl.load(x_ptr + row * stride_x + F + offs, mask=mask, other=0.0).to(ACC)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_PROBS:
        out = out * tl.load(probs_ptr + row).to(ACC)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, x_ptr, probs_ptr, grad_x_ptr, grad_probs_ptr, F,
                       stride_grad, stride_x, stride_grad_x,
                       HAS_PROBS: tl.constexpr, ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_PROBS:
        p = tl.load(probs_ptr + row).to(ACC)
    dp = tl.zeros([BLOCK_F], dtype=ACC)
    for f0 in range(0, F, BLOCK_F):
        offs = f0 + tl.arange(0, BLOCK_F)
        mask = offs < F
        g = tl.load(grad_ptr + row * stride_grad + offs, mask=mask, other=0.0).to(ACC)
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(ACC)
        up = tl.load(x_ptr + row * stride_x + F + offs, mask=mask, other=0.0).to(ACC)
        sig = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sig
        if HAS_PROBS:
            dp += g * silu * up
            g = g * p
        grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = g * silu
        dst = grad_x_ptr + row * stride_grad_x + offs
        tl.store(dst, grad_gate.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + F, grad_up.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(grad_probs_ptr + row, tl.sum(dp, axis=0).to(grad_probs_ptr.dtype.element_ty))


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [..., D] -> [N, D]


def swiglu_forward_triton(x: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = _rows(x)
    n, f = x2.shape[0], x2.shape[1] // 2
    out = x2.new_empty(n, f)
    if n and f:
        block = min(triton.next_power_of_2(f), 1024)
        p = probs.reshape(-1).contiguous() if probs is not None else x2
        _swiglu_fwd_kernel[(n, triton.cdiv(f, block))](
            x2, p, out, f, x2.stride(0), out.stride(0),
            HAS_PROBS=probs is not None, ACC=_acc(x.dtype), BLOCK_F=block)
    return out.reshape(x.shape[:-1] + (f,))


def swiglu_backward_triton(grad: torch.Tensor, x: torch.Tensor,
                           probs: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    x2, g2 = _rows(x), _rows(grad)
    n, f = x2.shape[0], x2.shape[1] // 2
    grad_x = torch.empty_like(x2)
    grad_probs = None
    if probs is not None:
        grad_probs = torch.empty(n, dtype=probs.dtype, device=probs.device)
    if n and f:
        block = min(triton.next_power_of_2(f), 1024)
        p = probs.reshape(-1).contiguous() if probs is not None else x2
        _swiglu_bwd_kernel[(n,)](
            g2, x2, p, grad_x, grad_probs if grad_probs is not None else grad_x, f,
            g2.stride(0), x2.stride(0), grad_x.stride(0),
            HAS_PROBS=probs is not None, ACC=_acc(x.dtype), BLOCK_F=block)
    elif grad_probs is not None:
        grad_probs.zero_()
    if grad_probs is not None:
        grad_probs = grad_probs.reshape(probs.shape)
    return grad_x.reshape(x.shape), grad_probs
