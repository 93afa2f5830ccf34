"""Weighted SwiGLU of the experts: ``silu(gate) * up * prob``.

Layout: the experts' fc1 output is ``x[..., 2F] = [gate | up]``, two contiguous
halves (``gate = x[..., :F]``, ``up = x[..., F:]``), not interleaved. Multiplying by
the routing prob here (rather than in unpermute) keeps it inside a kernel that
already reads every element.

The autograd Function saves only ``x`` and ``probs`` and recomputes ``silu`` in the
backward: the activations of the widest layer of the model are not kept twice.
bf16/fp16 inputs are computed in float32 and rounded once.
"""
from typing import Optional

import torch

BACKENDS = ("torch", "triton")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def swiglu_forward_torch(x: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, 2F] -> [N, F]`` without autograd bookkeeping (one [N, F] allocation for float32)."""
    cd = _compute_dtype(x.dtype)
    gate, up = x.to(cd).chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate)
    out.mul_(up)
    if probs is not None:
        out.mul_(probs.to(cd).unsqueeze(-1))
    return out.to(x.dtype)


# Rows per step of the CPU backward: its 8 passes over a ~1 MiB [rows, F] chunk stay in
# cache instead of streaming [N, F] from memory 8 times (CPU, float32, 2 threads, loaded
# machine, unchunked = 1: 0.63 CPU time / 0.65 wall at [8192, 1024], 0.88 / 0.67 at
# [4096, 512]; 64 KiB and 256 KiB chunks no better). On a GPU the whole tensor is one
# step: chunks would only add launches.
_CHUNK_BYTES = 1 << 20


def swiglu_backward_torch(grad: torch.Tensor, x: torch.Tensor,
                          probs: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Grads of ``x`` ([..., 2F]) and ``probs`` ([...]) from ``grad`` ([..., F]).

    ``aten.silu_backward`` does ``d silu / d gate`` in one pass, and both halves are
    written straight into the result: 8 passes over [N, F] where the written-out
    derivative took 12.
    """
    cd = _compute_dtype(x.dtype)
    width = x.shape[-1]
    xs, gs = x.reshape(-1, width), grad.reshape(-1, width // 2)  # [N, 2F], [N, F]
    ps = None if probs is None else probs.reshape(-1)  # [N]
    grad_x = torch.empty_like(xs)
    grad_probs = None if ps is None else torch.empty_like(ps)
    rows = xs.shape[0] if x.is_cuda else max(1, _CHUNK_BYTES // max(1, width // 2 * cd.itemsize))
    for start in range(0, xs.shape[0], rows):
        part = slice(start, start + rows)
        gate, up = xs[part].to(cd).chunk(2, dim=-1)
        g = gs[part].to(cd)
        out = grad_x[part] if cd == x.dtype else torch.empty(gate.shape[0], width, dtype=cd, device=x.device)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.mul(g, torch.nn.functional.silu(gate), out=grad_up)
        if ps is not None:
            p = ps[part].to(cd).unsqueeze(-1)
            grad_probs[part] = (grad_up * up).sum(-1)
            grad_up.mul_(p)
            g = g * p
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=grad_gate)
        if cd != x.dtype:
            grad_x[part] = out
    return grad_x.view(x.shape), None if probs is None else grad_probs.view(probs.shape)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, use_triton):
        ctx.save_for_backward(x, probs)
        ctx.use_triton = use_triton
        if use_triton:
            from .swiglu_triton import swiglu_forward_triton
            return swiglu_forward_triton(x, probs)
        return swiglu_forward_torch(x, probs)

    @staticmethod
    def backward(ctx, grad):
        x, probs = ctx.saved_tensors
        if ctx.use_triton:
            from .swiglu_triton import swiglu_backward_triton
            grad_x, grad_probs = swiglu_backward_triton(grad, x, probs)
        else:
            grad_x, grad_probs = swiglu_backward_torch(grad, x, probs)
        if not ctx.needs_input_grad[1]:
            grad_probs = None
        return grad_x, grad_probs, None


def swiglu(x: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
           backend: str = "torch") -> torch.Tensor:
    """``x[..., 2F] = [gate | up]``, ``probs[...]`` or None -> ``[..., F]`` =
    ``silu(gate) * up * probs``. Differentiable w.r.t. x and probs."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2F] with an even last dim ([gate | up]), "
                         f"got shape {tuple(x.shape)}")
    if probs is not None and probs.shape != x.shape[:-1]:
        raise ValueError(f"probs shape {tuple(probs.shape)} must be {tuple(x.shape[:-1])} "
                         f"(one prob per row of x)")
    return _SwiGLU.apply(x, probs, backend == "triton")
