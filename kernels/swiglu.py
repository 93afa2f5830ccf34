"""Weighted SwiGLU of the experts: ``silu(gate) * up * prob``.

Layout: the experts' fc1 output is ``x[..., 2F] = [gate | up]``, two contiguous
halves (``gate = x[..., :F]``, ``up = x[..., F:]``), not interleaved. Multiplying by
the routing prob here (rather than in unpermute) keeps it inside a kernel that
already reads every element.

The autograd Function saves only ``x`` and ``probs`` and recomputes ``silu`` in the
backward: the activations of the widest layer of the model are not kept twice.
bf16/fp16 inputs are computed in float32 and rounded once.

Backends: ``torch`` (elementwise torch ops, any device), ``triton`` (CUDA, or the CPU
interpreter), ``cpu`` (one fused C loop each way, ``swiglu_cpu.py``; its exp is a
polynomial, so its numerics differ from torch's by rounding) and ``auto``, the default:
the rule of :mod:`moe_fold.kernels.backends`, ``cpu`` for CPU tensors and ``triton`` on
CUDA (sm80+). ``auto`` never falls back in silence: on a CPU without a C compiler it raises
and says to install one or to name ``torch`` (config key ``moe.swiglu_backend``).

:func:`clamped_swiglu` is gpt-oss's activation (``moe.activation: clamped_swiglu``), on the
same ``[gate | up]`` halves: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
with ``g = min(gate, limit)``. It is written in torch ops only (autograd gives its
backward), so it runs under the ``torch`` backend name alone: the config refuses another
``moe.swiglu_backend`` with it, and ``auto`` resolves to ``torch``.
"""
from typing import Optional

import torch

from . import backends

BACKENDS = ("auto",) + backends.OPS["swiglu"]


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


def swiglu_backward_torch(grad: torch.Tensor, x: torch.Tensor,
                          probs: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Grads of ``x`` ([..., 2F]) and ``probs`` ([...]) from ``grad`` ([..., F]).

    Seven whole-tensor ops, each one pass: ``aten.silu_backward`` does ``d silu / d gate``
    in one, ``linalg.vecdot`` the prob gradient's row dots in one, and both halves are
    written straight into the result. Whole tensors rather than cache-sized row chunks:
    on a CPU each op is one OpenMP region, and with ``OMP_WAIT_POLICY=PASSIVE`` waking the
    other threads costs about 70 us a region (2 threads), more than a chunk's cache misses
    save. bench/moe_layer.py's [8192, 2048] fc1 output, 2 threads: 19 ms a backward, where
    1 MiB chunks took 53 ms (and a batched-matmul row dot 11 ms instead of vecdot's 3 ms).
    """
    cd = _compute_dtype(x.dtype)
    width = x.shape[-1]
    xs, g = x.reshape(-1, width).to(cd), grad.reshape(-1, width // 2).to(cd)  # [N, 2F], [N, F]
    gate, up = xs.chunk(2, dim=-1)
    grad_x = torch.empty_like(xs)
    grad_gate, grad_up = grad_x.chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate)  # recomputed: the forward kept only x
    grad_silu = g * up  # d out / d silu(gate), before the prob
    grad_probs = None
    if probs is not None:
        p = probs.reshape(-1, 1).to(cd)  # [N, 1]
        grad_probs = torch.linalg.vecdot(grad_silu, silu).view(probs.shape).to(probs.dtype)
        torch.mul(g, p, out=grad_up)
        grad_up.mul_(silu)
        grad_silu.mul_(p)
    else:
        torch.mul(g, silu, out=grad_up)
    torch.ops.aten.silu_backward.grad_input(grad_silu, gate, grad_input=grad_gate)
    return grad_x.to(x.dtype).view(x.shape), grad_probs


@torch.library.custom_op("moe_fold::swiglu", mutates_args=())
def swiglu_op(x: torch.Tensor, probs: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """``silu(gate) * up * probs`` as one op the compiler does not look into; ``backend``
    may be ``auto`` (the device rule, resolved from ``x``'s device like any kernel
    dispatch). No argument checks: :func:`swiglu` makes them."""
    name = backends.resolve("swiglu", backend, x)
    if name == "triton":
        from .swiglu_triton import swiglu_forward_triton
        return swiglu_forward_triton(x, probs)
    if name == "cpu":
        from .swiglu_cpu import swiglu_forward_cpu
        width = x.shape[-1]
        return swiglu_forward_cpu(x.reshape(-1, width), None if probs is None else probs.reshape(-1)
                                  ).view(*x.shape[:-1], width // 2)
    return swiglu_forward_torch(x, probs)


@swiglu_op.register_fake
def _(x, probs, backend):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("moe_fold::swiglu_backward", mutates_args=())
def swiglu_backward_op(grad: torch.Tensor, x: torch.Tensor, probs: Optional[torch.Tensor], want_probs: bool,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Grads of ``x`` and ``probs`` (an empty tensor when not ``want_probs``)."""
    name = backends.resolve("swiglu", backend, x)
    if name == "triton":
        from .swiglu_triton import swiglu_backward_triton
        grad_x, grad_probs = swiglu_backward_triton(grad, x, probs)
    elif name == "cpu":
        from .swiglu_cpu import swiglu_backward_cpu
        width = x.shape[-1]
        grad_x, grad_probs = swiglu_backward_cpu(
            grad.reshape(-1, width // 2), x.reshape(-1, width), None if probs is None else probs.reshape(-1),
            want_probs=want_probs)
        grad_x = grad_x.view(x.shape)
        grad_probs = None if grad_probs is None else grad_probs.view(probs.shape)
    else:
        grad_x, grad_probs = swiglu_backward_torch(grad, x, probs)
    if not want_probs or grad_probs is None:
        grad_probs = x.new_empty(0)
    return grad_x, grad_probs


@swiglu_backward_op.register_fake
def _(grad, x, probs, want_probs, backend):
    return torch.empty_like(x), (torch.empty_like(probs) if want_probs and probs is not None else x.new_empty(0))


def _swiglu_setup(ctx, inputs, output):
    x, probs, backend = inputs
    ctx.save_for_backward(x, probs)
    ctx.backend = backend


def _swiglu_backward(ctx, grad):
    x, probs = ctx.saved_tensors
    want_probs = probs is not None and ctx.needs_input_grad[1]
    grad_x, grad_probs = swiglu_backward_op(grad, x, probs, want_probs, ctx.backend)
    return grad_x, (grad_probs if want_probs else None), None


swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def clamped_swiglu(x: torch.Tensor, probs: Optional[torch.Tensor] = None, *, alpha: float,
                   limit: float) -> torch.Tensor:
    """``x[..., 2F] = [gate | up]``, ``probs[...]`` or None -> ``[..., F]`` =
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) * probs``, ``g = min(gate, limit)``
    (transformers' GptOssExperts, whose checkpoints interleave gate and up: the importer
    de-interleaves them into these halves). bf16/fp16 are computed in float32, rounded once."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2F] with an even last dim ([gate | up]), got shape {tuple(x.shape)}")
    if probs is not None and probs.shape != x.shape[:-1]:
        raise ValueError(f"probs shape {tuple(probs.shape)} must be {tuple(x.shape[:-1])} (one prob per row of x)")
    cd = _compute_dtype(x.dtype)
    gate, up = x.to(cd).chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    out = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if probs is not None:
        out = out * probs.to(cd).unsqueeze(-1)
    return out.to(x.dtype)


def relu2(x: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[..., F]``, ``probs[...]`` or None -> ``relu(x)^2 * probs`` (Nemotron-H's squared
    ReLU, not gated). bf16/fp16 are computed in float32, rounded once."""
    cd = _compute_dtype(x.dtype)
    out = torch.relu(x.to(cd)).square()
    if probs is not None:
        out = out * probs.to(cd).unsqueeze(-1)
    return out.to(x.dtype)


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The concrete backend for ``x``: ``backend``, or for ``auto`` the device rule
    (:func:`moe_fold.kernels.backends.choose`). Raises if that backend cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return backends.resolve("swiglu", backend, x)


def swiglu(x: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
           backend: str = "auto") -> torch.Tensor:
    """``x[..., 2F] = [gate | up]``, ``probs[...]`` or None -> ``[..., F]`` =
    ``silu(gate) * up * probs``. Differentiable w.r.t. x and probs."""
    backend = resolve_backend(backend, x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2F] with an even last dim ([gate | up]), "
                         f"got shape {tuple(x.shape)}")
    if probs is not None and probs.shape != x.shape[:-1]:
        raise ValueError(f"probs shape {tuple(probs.shape)} must be {tuple(x.shape[:-1])} "
                         f"(one prob per row of x)")
    return swiglu_op(x, probs, backend)
