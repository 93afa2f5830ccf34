"""Weighted SwiGLU: every backend against an element loop, autograd and gradcheck; the
C backend's build, thread split and edge values."""

import math

import pytest
import torch

from moe_fold.kernels.swiglu import swiglu

BACKENDS = ["torch", "triton", "cpu"]


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
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert b.dtype == torch.bfloat16
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
    from tests.kernels.test_permute import compile_for_sm90

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


def _torch_reference(x, p, upstream):
    """Output and grads of the torch backend (float64 math, rounded to x's dtype)."""
    xr, pr = x.double().requires_grad_(), p.double().requires_grad_()
    out = swiglu(xr, pr, backend="torch")
    out.backward(upstream.double())
    return out, xr.grad, pr.grad


def test_auto_picks_cpu_on_cpu_and_without_a_compiler_says_how_to_fix(monkeypatch, tmp_path):
    """``auto`` is ``cpu`` on CPU whether or not a compiler is there: without one it raises
    (naming the compiler and the way out), it does not switch to other numerics."""
    from moe_fold.kernels import backends, swiglu_cpu
    from moe_fold.kernels.swiglu import resolve_backend

    assert resolve_backend("auto", torch.zeros(1, 2)) == "cpu"
    monkeypatch.setenv("CC", "no-such-compiler-moe-fold")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    swiglu_cpu._library.cache_clear()
    backends._probe.cache_clear()
    try:
        assert backends.choose_for("swiglu", torch.device("cpu"), torch.float32) == "cpu"
        for name in ("auto", "cpu"):
            with pytest.raises(backends.BackendUnavailable,
                               match="swiglu backend .*'cpu'.* cannot run here: BuildError: .*"
                                     "no-such-compiler-moe-fold.*not on PATH"):
                swiglu(torch.randn(2, 4), backend=name)
        assert resolve_backend("torch", torch.zeros(1, 2)) == "torch"
    finally:
        swiglu_cpu._library.cache_clear()
        backends._probe.cache_clear()
    assert list(tmp_path.iterdir()) == []


def _gpt_oss_gate(gate, up, alpha, limit):
    """transformers' GptOssExperts._apply_gate itself, fed its interleaved layout."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    interleaved = torch.stack([gate, up], dim=-1).flatten(-2)  # [..., F, 2] -> [..., 2F]: g0 u0 g1 u1 ...
    return GptOssExperts._apply_gate(SimpleNamespace(alpha=alpha, limit=limit), interleaved)


@pytest.mark.parametrize("with_probs", [False, True])
def test_clamped_swiglu_matches_transformers_gpt_oss(with_probs):
    from moe_fold.kernels.swiglu import clamped_swiglu

    torch.manual_seed(0)
    # Wide enough that both clamps bite (|x| up to ~20 against limit 7) on both sides.
    x = torch.randn(13, 2 * 11, dtype=torch.float64) * 8
    probs = torch.rand(13, dtype=torch.float64) if with_probs else None
    gate, up = x.chunk(2, dim=-1)
    assert (gate > 7).any() and (up < -7).any() and (up > 7).any()
    ref = _gpt_oss_gate(gate, up, 1.702, 7.0)
    if with_probs:
        ref = ref * probs[:, None]
    torch.testing.assert_close(clamped_swiglu(x, probs, alpha=1.702, limit=7.0), ref, rtol=0, atol=1e-12)
    # Gradients of x (and probs) in float64 against finite differences, clamps included.
    xg = x.clone().requires_grad_()
    pg = None if probs is None else probs.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, p: clamped_swiglu(a, p, alpha=1.702, limit=7.0), (xg, pg))


def test_clamped_swiglu_bf16_rounds_once_and_bad_shapes_raise():
    from moe_fold.kernels.swiglu import clamped_swiglu

    torch.manual_seed(1)
    x = torch.randn(5, 8) * 4
    out = clamped_swiglu(x.bfloat16(), alpha=1.5, limit=3.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, clamped_swiglu(x.bfloat16().float(), alpha=1.5, limit=3.0).bfloat16(),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="even last dim"):
        clamped_swiglu(torch.randn(3, 5), alpha=1.0, limit=1.0)
    with pytest.raises(ValueError, match=r"probs shape \(4,\) must be \(3,\)"):
        clamped_swiglu(torch.randn(3, 4), torch.rand(4), alpha=1.0, limit=1.0)
