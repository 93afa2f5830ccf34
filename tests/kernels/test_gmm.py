"""Grouped GEMM: every backend against the per-expert loop written here (forward, dx, dw)."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from moe_fold.kernels.gmm import available_backends, gmm, resolve_backend

from tests.helpers.paths import REPO

HAS_GROUPED_GEMM = importlib.util.find_spec("grouped_gemm") is not None and torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (counts, K, M): empty experts, one expert with every token, N = 0, odd sizes; equal
# counts (the torch backend's bmm path on CPU: N = 0, one expert, odd and even sizes).
CASES = [
    ([5, 0, 9, 3], 16, 32),
    ([0, 37, 0], 24, 40),
    ([0, 0, 0], 8, 16),
    ([13, 1, 0, 7, 16], 5, 7),
    ([64], 32, 24),
    ([7, 7, 7], 5, 9),
    ([16, 16, 16, 16], 24, 40),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _reference(x, w, counts, trans_b, bias=None):
    """Forward and grads of (y * g).sum() in float64, one expert at a time (bias[e] added
    to expert e's rows when given)."""
    x = x.double().detach().requires_grad_()
    w = w.double().detach().requires_grad_()
    b = None if bias is None else bias.double().detach().requires_grad_()
    ys, start = [], 0
    for e, n in enumerate(counts):
        we = w[e].t() if trans_b else w[e]
        y = x[start : start + n] @ we
        ys.append(y if b is None else y + b[e])
        start += n
    return torch.cat(ys), x, w, b


def _check(backend, counts, k, m, trans_b, dtype, grad_kind="random", with_bias=False):
    torch.manual_seed(0)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, k, device=DEVICE).to(dtype).requires_grad_()
    w_shape = (e, m, k) if trans_b else (e, k, m)
    w = (torch.randn(w_shape, device=DEVICE) / k**0.5).to(dtype).requires_grad_()
    bias = torch.randn(e, m, device=DEVICE).to(dtype).requires_grad_() if with_bias else None
    y = gmm(x, w, torch.tensor(counts), trans_b=trans_b, backend=backend, bias=bias)
    y_ref, x_ref, w_ref, b_ref = _reference(x, w, counts, trans_b, bias)
    assert y.shape == (n, m) and y.dtype == dtype
    if grad_kind == "sum":
        y.sum().backward()
        y_ref.sum().backward()
    else:
        g = torch.randn(n, m, device=DEVICE).to(dtype)
        (y * g).sum().backward()
        (y_ref * g.double()).sum().backward()
    tol = TOL[dtype]
    # Scale the tolerance with the length of the contraction each result sums over.
    torch.testing.assert_close(y.double(), y_ref, atol=tol * k**0.5, rtol=tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=tol * m**0.5, rtol=tol)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, atol=tol * max(n, 1) ** 0.5 * 2, rtol=tol)
    if with_bias:
        # An expert with no rows gets a zero bias grad, not None.
        torch.testing.assert_close(bias.grad.double(), b_ref.grad, atol=tol * max(n, 1) ** 0.5, rtol=tol)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("counts,k,m", CASES)
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_float32(backend, counts, k, m, trans_b):
    _check(backend, counts, k, m, trans_b, torch.float32)


@pytest.mark.parametrize("counts", [[6, 0, 19, 2], [9, 9]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_half_dtypes(backend, trans_b, dtype, counts):
    _check(backend, counts, 24, 40, trans_b, dtype)


@pytest.mark.parametrize("counts", [[3, 0, 9], [6, 6]])
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_grad_of_sum(backend, counts):
    # The gradient of .sum() is an expanded tensor with zero strides.
    _check(backend, counts, 16, 32, False, torch.float32, grad_kind="sum")
    _check(backend, counts, 24, 40, True, torch.float32, grad_kind="sum")


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("counts,k,m", CASES)
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_bias_float32(backend, counts, k, m, trans_b):
    # gpt-oss's biased experts: bias[e] on group e's rows, its grad the sum of those rows' dy.
    _check(backend, counts, k, m, trans_b, torch.float32, with_bias=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_bias_half_dtypes_and_grad_of_sum(backend, dtype):
    _check(backend, [6, 0, 19, 2], 24, 40, False, dtype, with_bias=True)
    _check(backend, [9, 9], 16, 32, True, torch.float32, grad_kind="sum", with_bias=True)


def test_bias_with_tensor_counts_and_bad_bias_raises():
    # Counts as an int tensor (the torch backend gathers by them with output_size) match a list on loop,
    # and both add each group's own bias (every backend adds it in one shared step: checked by hand).
    x, w, bias = torch.randn(7, 4), torch.randn(2, 4, 3), torch.randn(2, 3)
    counts = torch.tensor([5, 2])
    by_hand = torch.cat([x[:5] @ w[0] + bias[0], x[5:] @ w[1] + bias[1]])
    torch.testing.assert_close(gmm(x, w, counts, backend="torch", bias=bias), by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gmm(x, w, [5, 2], backend="loop", bias=bias), by_hand, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"bias\(3, 3\) must be \[E, M\] = \[2, 3\]"):
        gmm(x, w, counts, backend="torch", bias=torch.randn(3, 3))
    with pytest.raises(ValueError, match="bias .*torch.float64.* must share w's dtype"):
        gmm(x, w, counts, backend="loop", bias=bias.double())


@pytest.mark.parametrize("counts", [[4, 0, 7], [5, 5, 5]])
def test_counts_as_list_and_non_contiguous_operands(counts):
    torch.manual_seed(1)
    x = torch.randn(32, 11)[::2, :9]  # [16, 9] with a row stride of 22
    w = torch.randn(3, 40, 9).transpose(1, 2)[:, :, ::3]  # [3, 9, 14], no unit stride
    x = x[: sum(counts)]
    a, b = counts[0], counts[0] + counts[1]
    ref = torch.cat([x[:a] @ w[0], x[a:b] @ w[1], x[b:] @ w[2]])
    for backend in ["torch", "triton", "loop"]:
        y = gmm(x, w, counts, backend=backend)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_float64_torch_backend_raises_and_auto_picks_loop():
    x, w = torch.randn(4, 16, dtype=torch.float64), torch.randn(2, 16, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got x.dtype=torch.float64"):
        gmm(x, w, [1, 3], backend="torch")
    assert resolve_backend("auto", x) == "loop"
    y = gmm(x, w, [1, 3])
    torch.testing.assert_close(y, torch.cat([x[:1] @ w[0], x[1:] @ w[1]]))


def test_the_backend_argument_or_the_rule_chooses():
    x = torch.randn(4, 16)
    assert resolve_backend("loop", x) == "loop"
    assert resolve_backend(None, x) == resolve_backend("auto", x) == "torch"  # the CPU rule for float32


def test_unknown_backend_and_bad_counts():
    x, w = torch.randn(5, 16), torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match=r"backend='fast' is not a grouped GEMM backend; allowed: auto, grouped_gemm"):
        gmm(x, w, [2, 3], backend="fast")
    with pytest.raises(ValueError, match="sums to 4, must equal the rows of x"):
        gmm(x, w, [2, 2])
    with pytest.raises(ValueError, match="has 3 entries, must be one per expert"):
        gmm(x, w, torch.tensor([2, 2, 1]))
    with pytest.raises(ValueError, match="negative count"):
        gmm(x, w, [6, -1])
    with pytest.raises(ValueError, match="disagree on K"):
        gmm(x, w, [2, 3], trans_b=True)
    with pytest.raises(ValueError, match="1-D int tensor"):
        gmm(x, w, torch.tensor([2.0, 3.0]))


def test_available_backends():
    names = available_backends()
    assert names[0] == "auto" and "torch" in names and "loop" in names
    assert ("grouped_gemm" in names) == HAS_GROUPED_GEMM
    assert "triton" in names  # conftest sets TRITON_INTERPRET=1


def test_bench_gemm_prints_its_fields():
    cmd = [sys.executable, str(REPO / "bench" / "gemm.py"), "--tokens", "24", "--topk", "2", "--hidden", "16",
           "--ffn", "8", "--experts", "4", "--repeats", "1", "--backends", "loop,torch", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["backend"], r["routing"]) for r in rows] == [
        ("loop", "balanced"), ("torch", "balanced"), ("loop", "skewed"), ("torch", "skewed")
    ]
    flops = 3 * 2 * 48 * (16 * 16 + 8 * 16)
    for r in rows:
        assert r["bench"] == "gemm" and r["tokens_per_expert_mean"] == 12.0
        assert r["ratio_to_dense"] == pytest.approx(r["ms_dense"] / r["ms"], rel=0.02, abs=1e-3)
        assert r["ratio_to_dense_cpu"] == pytest.approx(r["ms_dense_cpu"] / r["ms_cpu"], rel=0.02, abs=1e-3)
        assert r["gflops"] == pytest.approx(flops / r["ms"] / 1e6, rel=0.02, abs=0.006)
    # 12 rows for each of the 4 experts are a batch for the torch backend; skewed ones are not.
    assert [r["path"] for r in rows] == [None, "bmm", None, "grouped_mm"]
    skewed = rows[2]
    # Zipf shares 1, 1/2, 1/3, 1/4 of 48 rows floor to 23, 11, 7, 5; the remaining 2 go to expert 0.
    assert (skewed["tokens_per_expert_min"], skewed["tokens_per_expert_max"]) == (5, 25)


def test_bench_gemm_bias_prints_the_overhead_of_the_same_backend():
    cmd = [sys.executable, str(REPO / "bench" / "gemm.py"), "--tokens", "24", "--topk", "2", "--hidden", "16",
           "--ffn", "8", "--experts", "4", "--repeats", "1", "--backends", "torch", "--threads", "1",
           "--routing", "skewed", "--bias"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plain, biased = [json.loads(line) for line in out.stdout.splitlines()]
    assert (plain["bias"], biased["bias"], "bias_overhead" in plain) == (False, True, False)
    assert biased["bias_overhead"] == pytest.approx(biased["ms"] / plain["ms"], rel=0.02, abs=1e-3)
    assert biased["bias_overhead_cpu"] == pytest.approx(biased["ms_cpu"] / plain["ms_cpu"], rel=0.02, abs=1e-3)
