"""Grouped GEMM in Triton: forward, dx and dw, no host synchronisation.

Two kernels, because the grouping sits on different axes:

- ``_rows_kernel``: the groups split the rows of the output, ``y[rows_e] = a[rows_e] @ b[e]``.
  It computes the forward (b = w) and dx (b = w transposed, a stride swap, no copy).
- ``_outer_kernel``: the groups split the contraction axis, ``dw[e] = a[rows_e]^T @ d[rows_e]``,
  a reduction over the rows of one group that the rows kernel cannot express.

Row tiles never straddle two groups: a tile table built on the device from the counts
maps each program to (group, first row). Its length is an upper bound known on the host
(ceil(N / BLOCK_M) + E), and programs past the real tiles return at once, so counts on
the device are never read back. Odd sizes are handled with masks.

The CPU interpreter (TRITON_INTERPRET=1, triton 3.9) mis-reads bfloat16 operands of
``tl.dot``, so under the interpreter bfloat16 tiles are upcast to float32 before the dot;
the products and the float32 accumulation are the same, and on GPU the tiles go to
``tl.dot`` unchanged.
"""

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
# Environment: Triton's own switch to its CPU interpreter, read as Triton does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, c_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr,
    num_groups, K, M,
    stride_an, stride_ak, stride_be, stride_bk, stride_bm, stride_cn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.load(tile_group_ptr + tile)
    if g >= num_groups:
        return
    row_end = tl.load(group_end_ptr + g).to(tl.int64)
    rows = tl.load(tile_row_ptr + tile).to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < M
    b_base = b_ptr + g.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_an + ks[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bm,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(c_ptr + rows[:, None] * stride_cn + cols[None, :] * stride_cm,
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _outer_kernel(
    a_ptr, d_ptr, c_ptr, group_start_ptr, group_end_ptr,
    P, Q,
    stride_an, stride_ap, stride_dn, stride_dq, stride_ce, stride_cp, stride_cq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = ps < P
    q_ok = qs < Q
    start = tl.load(group_start_ptr + g).to(tl.int64)
    end = tl.load(group_end_ptr + g).to(tl.int64)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < end
        # a read transposed through its strides: [BLOCK_P, BLOCK_R]
        a = tl.load(a_ptr + rs[None, :] * stride_an + ps[:, None] * stride_ap,
                    mask=p_ok[:, None] & r_ok[None, :], other=0.0)
        d = tl.load(d_ptr + rs[:, None] * stride_dn + qs[None, :] * stride_dq,
                    mask=r_ok[:, None] & q_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            d = d.to(tl.float32)
        acc = tl.dot(a, d, acc, input_precision=PRECISION)
    c = c_ptr + g.to(tl.int64) * stride_ce + ps[:, None] * stride_cp + qs[None, :] * stride_cq
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def _launch_args(x: torch.Tensor) -> dict:
    # float32 follows torch's own TF32 switch, so 'triton' matches 'loop' on the same GPU;
    # 16-bit inputs keep Triton's default ("tf32" names the tensor-core path for them).
    exact_fp32 = x.dtype == torch.float32 and not (x.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    return {
        "UPCAST": _INTERPRET and x.dtype == torch.bfloat16,
        "PRECISION": "ieee" if exact_fp32 else "tf32",
    }


def _tile_table(ends: torch.Tensor, counts: torch.Tensor, n: int):
    """Per row tile: its group (num_groups past the last real tile) and its first row."""
    e = counts.numel()
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    tile_end = torch.cumsum(tiles, 0)  # [E]
    t = torch.arange(triton.cdiv(n, BLOCK_M) + e, device=counts.device)  # [T], an upper bound
    group = torch.searchsorted(tile_end, t, right=True)  # [T] in [0, E]
    g = group.clamp(max=e - 1)
    first_row = (ends - counts)[g] + (t - (tile_end - tiles)[g]) * BLOCK_M  # [T]
    return group.to(torch.int32), first_row


def _rows_gemm(a, b, ends, table, m):
    """``a[N, K]``, ``b[E, K, M]`` (any strides) -> ``[N, M]``."""
    n, k = a.shape
    out = a.new_empty(n, m)
    if n == 0 or m == 0:
        return out
    if k == 0:
        return out.zero_()
    group, first_row = table
    grid = (group.numel(), triton.cdiv(m, BLOCK_N))
    _rows_kernel[grid](
        a, b, out, group, first_row, ends,
        b.shape[0], k, m,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **_launch_args(a),
    )
    return out


def _outer_gemm(a, d, starts, ends):
    """``a[N, P]``, ``d[N, Q]`` -> ``[E, P, Q]``, the sum over each group's rows of ``a^T d``."""
    e, p, q = starts.numel(), a.shape[1], d.shape[1]
    out = a.new_zeros(e, p, q)
    if a.shape[0] == 0 or out.numel() == 0:
        return out
    grid = (e, triton.cdiv(p, BLOCK_M), triton.cdiv(q, BLOCK_N))
    _outer_kernel[grid](
        a, d, out, starts, ends,
        p, q,
        a.stride(0), a.stride(1), d.stride(0), d.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_P=BLOCK_M, BLOCK_Q=BLOCK_N, BLOCK_R=BLOCK_K, **_launch_args(a),
    )
    return out


class _TritonGMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, trans_b):
        counts = counts.to(device=x.device, dtype=torch.int64)
        ends = torch.cumsum(counts, 0)  # [E] group ends
        table = _tile_table(ends, counts, x.shape[0])
        ctx.save_for_backward(x, w, counts, ends, *table)
        ctx.trans_b = trans_b
        b = w.transpose(1, 2) if trans_b else w  # [E, K, M]
        return _rows_gemm(x, b, ends, table, b.shape[2])  # [N, K] -> [N, M]

    @staticmethod
    def backward(ctx, dy):
        x, w, counts, ends, group, first_row = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            b = w if ctx.trans_b else w.transpose(1, 2)  # [E, M, K]
            dx = _rows_gemm(dy, b, ends, (group, first_row), x.shape[1])  # [N, M] -> [N, K]
        if ctx.needs_input_grad[1]:
            starts = ends - counts
            if ctx.trans_b:
                dw = _outer_gemm(dy, x, starts, ends)  # [E, M, K]
            else:
                dw = _outer_gemm(x, dy, starts, ends)  # [E, K, M]
        return dx, dw, None, None


def gmm_triton(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """``counts``: int tensor [E] of rows per group, on any device (moved to x's device)."""
    if not x.is_cuda and not _INTERPRET:
        raise RuntimeError(
            f"gmm backend 'triton' needs CUDA tensors (x is on {x.device}), or TRITON_INTERPRET=1 "
            "set before import to run the Triton CPU interpreter (slow; for tests)"
        )
    return _TritonGMM.apply(x, w, counts, trans_b)


def gmm_triton_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """The weight gradient of :func:`gmm_triton`: ``[E, K, M]`` (``[E, M, K]`` with ``trans_b``)."""
    counts = counts.to(device=x.device, dtype=torch.int64)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    return _outer_gemm(dy, x, starts, ends) if trans_b else _outer_gemm(x, dy, starts, ends)
