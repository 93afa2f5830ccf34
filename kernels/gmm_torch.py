"""Grouped GEMM on ``torch.nn.functional.grouped_mm`` (CPU and CUDA).

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


def gmm_torch(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """``counts``: int tensor [E] of rows per group, on any device."""
    check_torch_dtype(x)
    offs = torch.cumsum(counts.to(device=x.device), 0, dtype=torch.int32)  # [E] group ends
    return _GroupedMM.apply(x, w, offs, trans_b)
