"""The kernels COMPILED on a GPU (not the Triton interpreter the rest of the suite uses):
grouped GEMM (every backend), permute / unpermute / sort_chunks, SwiGLU and the fused
router top-k, each against the torch reference (float64 on the CPU), in bfloat16 and
float32, forward and gradients. Run by the gpu child process (tests/helpers/gpu_support.py);
skipped with the reason where no GPU is visible."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe_fold.dispatch.router import topk_routing
from moe_fold.kernels.gmm import gmm
from moe_fold.kernels.permute import permute, permute_padded, sort_chunks, unpermute
from moe_fold.kernels.swiglu import swiglu
from tests.kernels.test_gmm import _reference as gmm_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
# float32 on CUDA may run matmuls in TF32 (10-bit mantissa) where allowed: its tolerance
# is bf16-like for the GEMMs, float32-like for the elementwise kernels.
GEMM_TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
ELEMENT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HAS_GROUPED_GEMM = importlib.util.find_spec("grouped_gemm") is not None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_triton_kernels_are_compiled_not_interpreted():
    """The gpu process imported the kernels without TRITON_INTERPRET: JIT functions that
    compile for the GPU, and the GEMM's interpreter-only upcast is off."""
    from triton.runtime.jit import JITFunction

    from moe_fold.kernels import gmm_triton, permute_triton, swiglu_triton, topk_triton

    kernels = [gmm_triton._rows_kernel, gmm_triton._outer_kernel, permute_triton._gather_rows_kernel,
               permute_triton._sum_rows_kernel, swiglu_triton._swiglu_fwd_kernel, swiglu_triton._swiglu_bwd_kernel,
               topk_triton._topk_fwd_kernel, topk_triton._topk_bwd_kernel]
    assert all(type(k) is JITFunction for k in kernels), [type(k).__name__ for k in kernels]
    assert gmm_triton._INTERPRET is False


GEMM_BACKENDS = ["triton", "torch", "loop",
                 pytest.param("grouped_gemm", marks=pytest.mark.skipif(
                     not HAS_GROUPED_GEMM, reason="the grouped_gemm package is not installed (pip install "
                                                  "'moe-fold[gpu]')"))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("backend", GEMM_BACKENDS)
def test_gmm(backend, trans_b, dtype):
    if backend == "grouped_gemm" and dtype != torch.bfloat16:
        pytest.skip("grouped_gemm computes bfloat16 only")
    counts = [37, 0, 128, 5, 91, 1, 0, 250]  # empty experts, odd sizes, a tile-sized one
    n, e, k, m = sum(counts), len(counts), 96, 160
    g = _gen(0)
    x0 = torch.randn(n, k, generator=g).to(dtype)
    w0 = (torch.randn((e, m, k) if trans_b else (e, k, m), generator=g) / k ** 0.5).to(dtype)
    dy = torch.randn(n, m, generator=g).to(dtype)
    x, w = x0.cuda().requires_grad_(), w0.cuda().requires_grad_()
    y = gmm(x, w, torch.tensor(counts, device="cuda"), trans_b=trans_b, backend=backend)
    (y * dy.cuda()).sum().backward()
    y_ref, x_ref, w_ref = gmm_reference(x0, w0, counts, trans_b)
    (y_ref * dy.double()).sum().backward()
    tol = GEMM_TOL[dtype]
    assert y.dtype == dtype and y.is_cuda
    torch.testing.assert_close(y.double().cpu(), y_ref, atol=tol * k ** 0.5, rtol=tol)
    torch.testing.assert_close(x.grad.double().cpu(), x_ref.grad, atol=tol * m ** 0.5, rtol=tol)
    torch.testing.assert_close(w.grad.double().cpu(), w_ref.grad, atol=tol * max(counts) ** 0.5 * 2, rtol=tol)


def _routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(tokens, experts, generator=_gen(seed))
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, 1).indices, True)
    rmap[3] = False  # a token routed nowhere
    return rmap, scores * rmap


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "padded"])
def test_permute_unpermute(padded, dtype):
    """Triton permute -> unpermute (prob-weighted) on CUDA against the torch backend in
    float64 on the CPU: values and the gradients of tokens and probs."""
    t, h, e, k = 300, 160, 16, 4
    rmap, probs0 = _routing(t, e, k, seed=1)
    tokens0 = torch.randn(t, h, generator=_gen(2)).to(dtype)
    upstream = torch.randn(t, h, generator=_gen(3))
    capacity = int(rmap.sum(0).max()) + 3

    def run(tokens, probs, routing, backend):
        if padded:
            rows, row_probs, index = permute_padded(tokens, routing, probs, capacity, backend=backend)
        else:
            rows, row_probs, index = permute(tokens, routing, probs, backend=backend)
        return rows, unpermute(rows, index, t, probs=row_probs, backend=backend), index

    tokens, probs = tokens0.cuda().requires_grad_(), probs0.cuda().requires_grad_()
    rows, out, index = run(tokens, probs, rmap.cuda(), "triton")
    (out.float() * upstream.cuda()).sum().backward()
    ref_tokens, ref_probs = tokens0.double().requires_grad_(), probs0.double().requires_grad_()
    ref_rows, ref_out, ref_index = run(ref_tokens, ref_probs, rmap, "torch")
    (ref_out * upstream.double()).sum().backward()
    tol = ELEMENT_TOL[dtype]
    assert torch.equal(index.cpu(), ref_index)
    assert torch.equal(rows.cpu(), ref_rows.to(dtype))  # a gather copies exactly
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(tokens.grad.double().cpu(), ref_tokens.grad, atol=tol * k, rtol=tol)
    torch.testing.assert_close(probs.grad.double().cpu(), ref_probs.grad, atol=tol * h ** 0.5, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sort_chunks(dtype):
    """The ep chunk reorder (Triton row gather) against the torch backend, with its gradient."""
    ranks, local = 4, 3
    sizes = torch.randint(0, 9, (ranks * local,), generator=_gen(4))
    x0 = torch.randn(int(sizes.sum()), 64, generator=_gen(5)).to(dtype)
    order = [r * local + le for le in range(local) for r in range(ranks)]
    x = x0.cuda().requires_grad_()
    y = sort_chunks(x, sizes.cuda(), order, backend="triton")
    ref = sort_chunks(x0.double().requires_grad_(), sizes, order, backend="torch")
    assert torch.equal(y.cpu(), ref.to(dtype))
    y.double().sum().backward()
    assert torch.equal(x.grad.cpu(), torch.ones_like(x0))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_swiglu(with_probs, dtype):
    n, f = 333, 512
    x0 = torch.randn(n, 2 * f, generator=_gen(6)).to(dtype)
    p0 = torch.rand(n, generator=_gen(7)) if with_probs else None
    upstream = torch.randn(n, f, generator=_gen(8)).to(dtype)
    x = x0.cuda().requires_grad_()
    p = p0.cuda().requires_grad_() if with_probs else None
    out = swiglu(x, p, backend="triton")
    out.backward(upstream.cuda())
    rx = x0.double().requires_grad_()
    rp = p0.double().requires_grad_() if with_probs else None
    ref = swiglu(rx, rp, backend="torch")
    ref.backward(upstream.double())
    tol = ELEMENT_TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.double().cpu(), rx.grad, atol=tol, rtol=tol)
    if with_probs:
        torch.testing.assert_close(p.grad.double().cpu(), rp.grad, atol=tol * f ** 0.5, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("score, pre_softmax", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_router_topk(score, pre_softmax, dtype):
    """The fused top-k kernel against the router's torch routing (float64, CPU): the same
    experts (ties go to the lower index in both), probs and logit gradients."""
    from moe_fold.kernels.topk_triton import topk_softmax_triton

    t, e, k = 517, 64, 6
    logits0 = (torch.randn(t, e, generator=_gen(9)) * 2).to(dtype)
    upstream = torch.randn(t, e, generator=_gen(10))
    logits = logits0.cuda().requires_grad_()
    probs, rmap = topk_softmax_triton(logits, k, score=score, pre_softmax=pre_softmax)
    (probs * upstream.cuda()).sum().backward()
    ref_logits = logits0.double().requires_grad_()
    ref_probs, ref_map = topk_routing(ref_logits, k, score=score, pre_softmax=pre_softmax)
    (ref_probs * upstream.double()).sum().backward()
    assert probs.dtype == torch.float32 and torch.equal(rmap.cpu(), ref_map)
    torch.testing.assert_close(probs.double().cpu(), ref_probs, atol=1e-6, rtol=1e-5)
    tol = ELEMENT_TOL[dtype]
    torch.testing.assert_close(logits.grad.double().cpu(), ref_logits.grad, atol=tol, rtol=tol)
