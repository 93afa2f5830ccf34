"""Grouped GEMM on torch ops: ``torch.nn.functional.grouped_mm`` (CPU and CUDA), or
``torch.bmm`` on CPU when every group has the same number of rows.

Equal groups (pad-to-capacity routing, or balanced dropless routing) are a batch: the rows
are ``[E, n, K]`` as a view, and bmm runs forward, dx and dw with no copy. On CPU it is the
faster choice because grouped_mm loops over the groups in C++, one multi-threaded matmul
(one OpenMP region) each, and a small matmul split over the threads wastes them; bmm
hands whole groups to threads in one region. bench/gemm.py, 2 threads, float32, 16
experts, H 256, F 512, equal groups, ratio_to_dense wall / CPU time, bmm vs grouped_mm:
16 rows a group 0.32 / 0.35 vs 0.22 / 0.21; 64: 0.77 / 0.82 vs 0.36 / 0.38; 256: 1.04 /
0.92 vs 0.69 / 0.70; 512: 0.73 / 0.95 vs 0.71 / 0.83 (1 thread: both about 0.86 at 256).

Unequal groups keep grouped_mm: padded to a batch they were measured to lose or tie once
the padding rows and the copies (pad the input, gather the output, pad dy) are paid. 16
experts of 256 rows on average, CPU-time ratio_to_dense of fc1 [256 -> 1024] / fc2
[512 -> 256] fwd + dx + dw: largest group 1.1x the mean, one padded bmm 0.76 / 0.65 vs
grouped_mm 0.68 / 0.85; 1.25x, 0.68 / 0.60 vs 0.67 / 0.86; the MoE layer benchmark's own
counts (largest 1.25x) in two padded levels (every group to 260 rows, the overflow of 4
groups to 59; 7% padding) 0.64 / 0.66 vs 0.62 / 0.82. Results equal grouped_mm's within
float rounding (tests/kernels/test_gmm.py).

grouped_mm has layout rules that the other backends do not:

- every stride other than the unit one must be a multiple of 16 bytes (CPU and CUDA). We
  copy an operand that breaks the rule into a buffer whose rows are padded to 16 bytes and
  pass a view of the original size, so the math is unchanged and nothing falls back;
- the incoming gradient of ``y.sum()`` is an expanded tensor with zero strides, which its
  own backward rejects, so we run forward and backward ourselves in one autograd Function
  and align the gradient like any other operand;
- ``offs`` are int32 cumulative group ends on the operands' device;
- dtypes: float32, bfloat16 and float16 on CPU; on CUDA bfloat16 (SM >= 80) is its fast
  path. Other dtypes raise (see ``check_torch_dtype``).
"""

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN_BYTES = 16


def check_torch_dtype(x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"gmm backend 'torch' (torch.nn.functional.grouped_mm) takes float32, bfloat16 or "
            f"float16, got x.dtype={x.dtype}; use backend='loop' for other dtypes"
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when grouped_mm accepts its strides, else a copy with 16-byte rows."""
    step = _ALIGN_BYTES // t.element_size()
    if t.stride(-1) == 1 and all(s % step == 0 and s > 0 for s in t.stride()[:-1]):
        return t
    last = t.shape[-1]
    padded = -(-last // step) * step
    buf = t.new_empty(*t.shape[:-1], padded)
    out = buf[..., :last]
    out.copy_(t)
    return out


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, trans_b):
        x, w = _aligned(x), _aligned(w)
        ctx.save_for_backward(x, w, offs)
        ctx.trans_b = trans_b
        b = w.transpose(1, 2) if trans_b else w  # [E, K, M]
        return F.grouped_mm(x, b, offs=offs)  # [N, K] -> [N, M]

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = _aligned(dy)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            b = w if ctx.trans_b else w.transpose(1, 2)  # [E, M, K]
            dx = F.grouped_mm(dy, b, offs=offs)  # [N, M] -> [N, K]
        if ctx.needs_input_grad[1]:
            # 2-D x 2-D form: the contraction runs over each group's rows.
            if ctx.trans_b:
                dw = F.grouped_mm(dy.t(), x, offs=offs)  # [M, N] x [N, K] -> [E, M, K]
            else:
                dw = F.grouped_mm(x.t(), dy, offs=offs)  # [K, N] x [N, M] -> [E, K, M]
        return dx, dw, None, None


class _BatchedMM(torch.autograd.Function):
    """Every group has ``n`` rows: ``x`` is ``[E, n, K]`` and each product one bmm."""

    @staticmethod
    def forward(ctx, x, w, trans_b):
        e, (rows, k) = w.shape[0], x.shape
        xb = x.reshape(e, rows // e, k)  # [N, K] -> [E, n, K]
        ctx.save_for_backward(xb, w)
        ctx.trans_b = trans_b
        b = w.transpose(1, 2) if trans_b else w  # [E, K, M]
        return torch.bmm(xb, b).view(rows, b.shape[2])  # [E, n, M] -> [N, M]

    @staticmethod
    def backward(ctx, dy):
        xb, w = ctx.saved_tensors
        e, n, k = xb.shape
        dyb = dy.reshape(e, n, dy.shape[1])  # [N, M] -> [E, n, M]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            b = w if ctx.trans_b else w.transpose(1, 2)  # [E, M, K]
            dx = torch.bmm(dyb, b).view(e * n, k)  # [E, n, K] -> [N, K]
        if ctx.needs_input_grad[1]:
            if ctx.trans_b:
                dw = torch.bmm(dyb.transpose(1, 2), xb)  # [E, M, n] x [E, n, K] -> [E, M, K]
            else:
                dw = torch.bmm(xb.transpose(1, 2), dyb)  # [E, K, n] x [E, n, M] -> [E, K, M]
        return dx, dw, None


def torch_path(x: torch.Tensor, host_counts: list[int] | None) -> str:
    """Which op the ``torch`` backend runs: ``bmm`` (CPU, counts on the host, all equal)
    or ``grouped_mm``."""
    if x.device.type == "cpu" and host_counts is not None and len(set(host_counts)) <= 1:
        return "bmm"
    return "grouped_mm"


def gmm_torch(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_b: bool, host_counts: list[int] | None = None
) -> torch.Tensor:
    """``counts``: int tensor [E] of rows per group, on any device; ``host_counts`` the same
    as a list when the caller has it on the host (it enables the bmm path)."""
    check_torch_dtype(x)
    if torch_path(x, host_counts) == "bmm":
        return _BatchedMM.apply(x, w, trans_b)
    offs = torch.cumsum(counts.to(device=x.device), 0, dtype=torch.int32)  # [E] group ends
    return _GroupedMM.apply(x, w, offs, trans_b)


def gmm_torch_wgrad(
    x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, trans_b: bool, host_counts: list[int] | None = None
) -> torch.Tensor:
    """The weight gradient of :func:`gmm_torch` (the same bmm or grouped_mm path):
    ``[E, K, M]`` (``[E, M, K]`` with ``trans_b``)."""
    check_torch_dtype(x)
    e = counts.shape[0]
    if torch_path(x, host_counts) == "bmm":
        xb = x.reshape(e, x.shape[0] // e, x.shape[1])  # [N, K] -> [E, n, K]
        dyb = dy.reshape(e, dy.shape[0] // e, dy.shape[1])  # [N, M] -> [E, n, M]
        if trans_b:
            return torch.bmm(dyb.transpose(1, 2), xb)  # [E, M, K]
        return torch.bmm(xb.transpose(1, 2), dyb)  # [E, K, M]
    offs = torch.cumsum(counts.to(device=x.device), 0, dtype=torch.int32)  # [E] group ends
    x, dy = _aligned(x), _aligned(dy)
    # 2-D x 2-D form: the contraction runs over each group's rows.
    if trans_b:
        return F.grouped_mm(dy.t(), x, offs=offs)  # [M, N] x [N, K] -> [E, M, K]
    return F.grouped_mm(x.t(), dy, offs=offs)  # [K, N] x [N, M] -> [E, K, M]
