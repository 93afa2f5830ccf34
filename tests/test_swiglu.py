"""Weighted SwiGLU: both backends against an element loop, autograd and gradcheck."""

import math

import pytest
import torch

from moe_fold.kernels.swiglu import swiglu

BACKENDS = ["torch", "triton"]


def _loop_swiglu(x, probs):
    """Element by element, from the definition: out[n, f] = silu(x[n, f]) *
    x[n, F + f] * probs[n] (python floats, float64)."""
    N, F = x.shape[0], x.shape[1] // 2
    out = torch.zeros(N, F, dtype=torch.float64)
    for n in range(N):
        for f in range(F):
            g, u = float(x[n, f]), float(x[n, F + f])
            p = 1.0 if probs is None else float(probs[n])
            out[n, f] = g / (1 + math.exp(-g)) * u * p
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_loop(backend, with_probs, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 2 * 5, generator=g) * 3).to(dtype)  # F = 5: not a power of 2
    probs = torch.rand(6, generator=g).to(dtype) if with_probs else None
    out = swiglu(x, probs, backend=backend)
    assert out.dtype == dtype and out.shape == (6, 5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), _loop_swiglu(x, probs), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_autograd_of_definition(backend):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(7, 2 * 6, generator=g, dtype=torch.float64) * 2
    p0 = torch.rand(7, generator=g, dtype=torch.float64)
    upstream = torch.randn(7, 6, generator=g, dtype=torch.float64)

    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    (swiglu(x, p, backend=backend) * upstream).sum().backward()

    xr, pr = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    gate, up = xr[:, :6], xr[:, 6:]
    (gate * torch.sigmoid(gate) * up * pr[:, None] * upstream).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(p.grad, pr.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    x = torch.randn(4, 2 * 3, dtype=torch.float64, requires_grad=True)
    p = torch.rand(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: swiglu(a, b, backend=backend), (x, p))
    assert torch.autograd.gradcheck(lambda a: swiglu(a, backend=backend), (x,))


def test_backends_agree_bf16_with_grads():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(9, 2 * 7, generator=g).bfloat16()
    p0 = torch.rand(9, generator=g).bfloat16()
    upstream = torch.randn(9, 7, generator=g).bfloat16()
    results = []
    for backend in BACKENDS:
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        out = swiglu(x, p, backend=backend)
        out.backward(upstream)
        results.append((out, x.grad, p.grad))
    for a, b in zip(*results):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_saves_only_inputs():
    x = torch.randn(3, 8, requires_grad=True)
    p = torch.rand(3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        swiglu(x, p)
    assert len(saved) == 2
    assert saved[0] is x and saved[1] is p


def test_bad_arguments():
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="probs shape"):
        swiglu(torch.randn(3, 4), torch.rand(4))
    with pytest.raises(ValueError, match="backend='cuda'"):
        swiglu(torch.randn(3, 4), backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims(backend):
    x = torch.randn(2, 3, 8)
    p = torch.rand(2, 3)
    out = swiglu(x, p, backend=backend)
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out, swiglu(x.reshape(6, 8), p.reshape(6)).reshape(2, 3, 4))


def test_kernels_compile_for_gpu():
    from test_permute import compile_for_sm90

    specs = []
    for has_probs in (True, False):
        consts = {"HAS_PROBS": has_probs, "ACC": "float32", "BLOCK_F": 1024}
        specs.append(["_swiglu_fwd_kernel",
                      {"x_ptr": "*bf16", "probs_ptr": "*fp32", "out_ptr": "*bf16", "F": "i32",
                       "stride_x": "i32", "stride_out": "i32"}, consts])
        specs.append(["_swiglu_bwd_kernel",
                      {"grad_ptr": "*bf16", "x_ptr": "*bf16", "probs_ptr": "*fp32",
                       "grad_x_ptr": "*bf16", "grad_probs_ptr": "*fp32", "F": "i32",
                       "stride_grad": "i32", "stride_x": "i32", "stride_grad_x": "i32"}, consts])
    compile_for_sm90("moe_fold.kernels.swiglu_triton", specs)
