"""Triton backend of ``permute.py``: fused row gather and atomic-free scatter-add.

Two kernels do all the work:

- ``_gather_rows_kernel``: ``out[i] = src[index[i]] * scale[i]`` (the sentinel
  index ``num_src`` gives a zero row), optionally also ``dot[i] = <src[index[i]],
  other[i]>``. Permute forward, sort_chunks, and unpermute backward (grad of the
  rows and of their probs in one pass).
- ``_sum_rows_kernel``: ``out[t] = sum over the rows r of token t of
  src[r] * scale[r]``, with the rows of each token listed in CSR form
  (``rows_by_token`` in token_rows.py), so every output row is written by one
  program and needs no atomics. Unpermute forward and permute backward.

Index bookkeeping (which row goes where) is small integer work done with torch ops;
the hot paths that move ``[N, H]`` data are the kernels. Accumulation is float32
(float64 for float64 inputs).
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .token_rows import rows_by_token


@triton.jit
def _gather_rows_kernel(src_ptr, index_ptr, scale_ptr, other_ptr, out_ptr, dot_ptr,
                        num_src, H, stride_src, stride_other, stride_out,
                        HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr,
                        ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src_row = tl.load(index_ptr + row)
    # A sentinel row reads nothing: its load mask is empty (a scalar-and-block mask
    # is not accepted by the interpreter, so the limit carries it).
    h_valid = tl.where(src_row < num_src, H, 0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + row).to(ACC)
    dot = tl.zeros([BLOCK_H], dtype=ACC)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = offs < H
        v = tl.load(src_ptr + src_row * stride_src + offs, mask=offs < h_valid,
                    other=0.0).to(ACC)
        if HAS_DOT:
            o = tl.load(other_ptr + row * stride_other + offs, mask=in_h,
                        other=0.0).to(ACC)
            dot += v * o
        if HAS_SCALE:
            v = v * scale
        tl.store(out_ptr + row * stride_out + offs, v.to(out_ptr.dtype.element_ty),
                 mask=in_h)
    if HAS_DOT:
        tl.store(dot_ptr + row, tl.sum(dot, axis=0).to(dot_ptr.dtype.element_ty))


@triton.jit
def _sum_rows_kernel(src_ptr, rows_ptr, row_ptr_ptr, scale_ptr, out_ptr,
                     H, stride_src, stride_out,
                     HAS_SCALE: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = offs < H
    start = tl.load(row_ptr_ptr + token)
    end = tl.load(row_ptr_ptr + token + 1)
    acc = tl.zeros([BLOCK_H], dtype=ACC)
    for j in range(start, end):
        r = tl.load(rows_ptr + j)
        v = tl.load(src_ptr + r * stride_src + offs, mask=in_h, other=0.0).to(ACC)
        if HAS_SCALE:
            v = v * tl.load(scale_ptr + r).to(ACC)
        acc += v
    tl.store(out_ptr + token * stride_out + offs, acc.to(out_ptr.dtype.element_ty),
             mask=in_h)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(h: int) -> int:
    return min(triton.next_power_of_2(max(h, 1)), 1024)


def _gather(src: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None,
            other: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``src[index] * scale`` ([num_src, H] -> [N, H]) and, with ``other``, the row
    dots ``<src[index[i]], other[i]>`` ([N])."""
    src = src.contiguous()
    n, h = index.numel(), src.shape[1]
    out = src.new_empty(n, h)
    dot = torch.empty(n, dtype=_torch_acc(src.dtype), device=src.device) \
        if other is not None else None
    if n:
        other_c = other.contiguous() if other is not None else out
        _gather_rows_kernel[(n,)](
            src, index.contiguous(), scale.contiguous() if scale is not None else src,
            other_c, out, dot if dot is not None else out,
            src.shape[0], h, src.stride(0), other_c.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, HAS_DOT=other is not None,
            ACC=_acc(src.dtype), BLOCK_H=_block(h))
    return out, dot


def _torch_acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sum_rows(src: torch.Tensor, rows: torch.Tensor, row_ptr: torch.Tensor,
              num_tokens: int, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, H]`` rows -> ``[T, H]`` per-token (weighted) sums; ``row_ptr[t]`` to
    ``row_ptr[t + 1]`` index the rows of token t in ``rows``."""
    src = src.contiguous()
    h = src.shape[1]
    out = src.new_empty(num_tokens, h)
    if num_tokens and h:
        block = _block(h)
        _sum_rows_kernel[(num_tokens, triton.cdiv(h, block))](
            src, rows.contiguous(), row_ptr.contiguous(),
            scale.contiguous() if scale is not None else src, out,
            h, src.stride(0), out.stride(0),
            HAS_SCALE=scale is not None, ACC=_acc(src.dtype), BLOCK_H=block)
    return out


def gather_rows(tokens: torch.Tensor, sorted_indices: torch.Tensor) -> torch.Tensor:
    """Permute forward: ``tokens[sorted_indices]`` with zero rows at the sentinel;
    ``[T, H] -> [N, H]`` (no autograd: :mod:`moe_fold.kernels.permute`'s op carries it)."""
    return _gather(tokens, sorted_indices)[0]


def unpermute_rows(permuted: torch.Tensor, sorted_indices: torch.Tensor,
                   num_tokens: int, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """Unpermute forward, and the permute's backward: ``[N, H] -> [T, H]``, rows weighted
    by probs and summed per token in one pass, without atomics."""
    rows, row_ptr = rows_by_token(sorted_indices, num_tokens)
    return _sum_rows(permuted, rows, row_ptr, num_tokens, probs)


def unpermute_rows_backward(grad: torch.Tensor, sorted_indices: torch.Tensor, permuted: Optional[torch.Tensor],
                            probs: Optional[torch.Tensor], want_probs: bool
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Unpermute backward: the rows' and the probs' grads in one pass."""
    grad_rows, grad_probs = _gather(grad, sorted_indices, probs, permuted if want_probs else None)
    return grad_rows, (grad_probs.to(probs.dtype) if grad_probs is not None else None)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for any ``[N, ...]`` tensor (no autograd; sort_chunks wraps it)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # [N, ...] -> [N, prod(...)]
    return _gather(flat, index)[0].reshape((index.numel(),) + tuple(x.shape[1:]))
