"""permute / unpermute / permute_padded / sort_chunks against loop references."""

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_fold.kernels.permute import (chunk_order, permute, permute_padded,
                                      sort_chunks, unpermute)

BACKENDS = ["torch", "triton"]


def _routing(kind, T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "topk":
        scores = torch.rand(T, E, generator=g)
        idx = scores.topk(k, dim=1).indices
        rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    elif kind == "sparse":  # empty experts and tokens routed nowhere
        rmap = torch.rand(T, E, generator=g) < 0.25
        rmap[:, 1] = False
        rmap[2] = False
    elif kind == "one_expert":
        rmap = torch.zeros(T, E, dtype=torch.bool)
        rmap[:, E - 1] = True
    elif kind == "all":  # k = E
        rmap = torch.ones(T, E, dtype=torch.bool)
    else:
        raise AssertionError(kind)
    probs = torch.rand(T, E, generator=g) * rmap
    return rmap, probs


def _loop_permute(tokens, rmap, probs):
    rows, rprobs, idx = [], [], []
    for e in range(rmap.shape[1]):
        for t in range(rmap.shape[0]):
            if rmap[t, e]:
                rows.append(tokens[t])
                rprobs.append(probs[t, e])
                idx.append(t)
    H = tokens.shape[1]
    if not rows:
        return tokens.new_zeros(0, H), probs.new_zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.stack(rows), torch.stack(rprobs), torch.tensor(idx)


def _loop_unpermute(permuted, idx, T, probs):
    out = [permuted.new_zeros(permuted.shape[1]) for _ in range(T)]
    for i in range(permuted.shape[0]):
        t = int(idx[i])
        if t < T:
            w = 1.0 if probs is None else probs[i]
            out[t] = out[t] + permuted[i] * w
    return torch.stack(out)


KINDS = ["topk", "sparse", "one_expert", "all"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_match_loop(backend, kind, dtype):
    T, E, H, k = 12, 4, 8, 2
    rmap, probs = _routing(kind, T, E, k)
    tokens = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    permuted, pprobs, idx = permute(tokens, rmap, probs, backend=backend)
    ref, ref_probs, ref_idx = _loop_permute(tokens, rmap, probs)
    assert permuted.dtype == dtype and idx.dtype == torch.long
    assert torch.equal(idx, ref_idx)
    assert torch.equal(permuted, ref)
    assert torch.equal(pprobs, ref_probs)

    out = unpermute(permuted, idx, T, probs=pprobs, backend=backend)
    assert out.dtype == dtype
    ref_out = _loop_unpermute(ref.double(), ref_idx, T, ref_probs.double())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    # Without probs: each token is its row times the number of experts it went to.
    plain = unpermute(permuted, idx, T, backend=backend)
    torch.testing.assert_close(plain.double(), tokens.double() * rmap.sum(1, keepdim=True),
                               atol=tol, rtol=tol)


def test_permute_without_probs_and_empty_map():
    T, E, H = 5, 3, 4
    tokens = torch.randn(T, H)
    rmap = torch.zeros(T, E, dtype=torch.bool)
    for backend in BACKENDS:
        permuted, pprobs, idx = permute(tokens, rmap, None, backend=backend)
        assert pprobs is None and permuted.shape == (0, H) and idx.shape == (0,)
        assert torch.equal(unpermute(permuted, idx, T, backend=backend), torch.zeros(T, H))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["topk", "sparse"])
def test_gradients_match_loop_autograd(backend, kind):
    T, E, H, k = 10, 4, 6, 2
    rmap, probs0 = _routing(kind, T, E, k, seed=3)
    g = torch.Generator().manual_seed(4)
    tokens0 = torch.randn(T, H, generator=g, dtype=torch.float64)
    upstream = torch.randn(T, H, generator=g, dtype=torch.float64)

    def run(fn_perm, fn_unperm):
        tokens = tokens0.clone().requires_grad_()
        probs = probs0.double().clone().requires_grad_()
        permuted, pprobs, idx = fn_perm(tokens, rmap, probs)
        # A non-linearity between the two makes the grad of permuted non-trivial.
        out = fn_unperm(permuted.sin(), idx, T, pprobs)
        (out * upstream).sum().backward()
        return out.detach(), tokens.grad, probs.grad

    got = run(lambda x, m, p: permute(x, m, p, backend=backend),
              lambda y, i, n, p: unpermute(y, i, n, probs=p, backend=backend))
    ref = run(_loop_permute, _loop_unpermute)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    T, E, H = 5, 3, 3
    rmap, probs = _routing("sparse", T, E, 2, seed=5)
    tokens = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    probs = probs.double().requires_grad_()

    def f(x, p):
        permuted, pprobs, idx = permute(x, rmap, p, backend=backend)
        return unpermute(permuted * permuted, idx, T, probs=pprobs, backend=backend)

    assert torch.autograd.gradcheck(f, (tokens, probs))

    def f_padded(x, p):
        permuted, pprobs, idx = permute_padded(x, rmap, p, 4, backend=backend)
        return unpermute(permuted * permuted, idx, T, probs=pprobs, backend=backend)

    assert torch.autograd.gradcheck(f_padded, (tokens, probs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_permute_padded_layout(backend, kind):
    T, E, H, C = 8, 4, 5, 8
    rmap, probs = _routing(kind, T, E, 2, seed=6)
    tokens = torch.randn(T, H)
    permuted, pprobs, idx = permute_padded(tokens, rmap, probs, C, backend=backend)
    assert permuted.shape == (E * C, H) and pprobs.shape == (E * C,)
    assert idx.shape == (E * C,)
    for e in range(E):
        routed = [t for t in range(T) if rmap[t, e]]
        for s in range(C):
            row = e * C + s
            if s < len(routed):
                t = routed[s]
                assert idx[row] == t
                assert torch.equal(permuted[row], tokens[t])
                assert pprobs[row] == probs[t, e]
            else:  # padding slot: sentinel index T, zero row, prob 0
                assert idx[row] == T
                assert torch.equal(permuted[row], torch.zeros(H))
                assert pprobs[row] == 0
    out = unpermute(permuted, idx, T, probs=pprobs, backend=backend)
    ref = (probs.unsqueeze(2) * tokens.unsqueeze(1)).sum(1)  # [T, E, H] -> [T, H]
    torch.testing.assert_close(out, ref)


def test_permute_padded_overflow_raises():
    rmap = torch.zeros(6, 3, dtype=torch.bool)
    rmap[:, 0] = True
    with pytest.raises(RuntimeError, match="capacity=4"):
        permute_padded(torch.randn(6, 2), rmap, None, 4)


def test_bad_arguments():
    tokens = torch.randn(4, 3)
    with pytest.raises(ValueError, match="routing_map must be a bool"):
        permute(tokens, torch.ones(4, 2), None)
    with pytest.raises(ValueError, match="routing_map has 3 rows"):
        permute(tokens, torch.ones(3, 2, dtype=torch.bool), None)
    with pytest.raises(ValueError, match="backend='cuda'"):
        permute(tokens, torch.ones(4, 2, dtype=torch.bool), None, backend="cuda")
    with pytest.raises(ValueError, match="sorted_indices shape"):
        unpermute(tokens, torch.zeros(3, dtype=torch.long), 4)
    for backend in BACKENDS:  # 4 is the padding sentinel for 4 tokens; 5 is out of range
        with pytest.raises(RuntimeError, match="out of bounds"):
            unpermute(tokens, torch.tensor([0, 5, 1, 4]), 4, backend=backend)
    with pytest.raises(ValueError, match="split_sizes sum to 5"):
        sort_chunks(tokens, [2, 3], [1, 0])
    with pytest.raises(ValueError, match="not a permutation"):
        sort_chunks(tokens, [2, 2], [1, 1])


def _loop_sort_chunks(x, sizes, order):
    chunks, start = [], 0
    for s in sizes:
        chunks.append(x[start:start + s])
        start += s
    return torch.cat([chunks[i] for i in order])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sort_chunks(backend):
    R, L = 3, 2
    sizes = [2, 0, 3, 1, 4, 0]  # [source rank][local expert], with empty chunks
    x = torch.randn(sum(sizes), 5)
    order = chunk_order(R, L)
    assert order == [0, 2, 4, 1, 3, 5]
    y = sort_chunks(x, sizes, order, backend=backend)
    assert torch.equal(y, _loop_sort_chunks(x, sizes, order))
    # Sizes as a tensor (as they come from an all-to-all), and the way back.
    back_sizes = [sizes[i] for i in order]
    back = sort_chunks(y, torch.tensor(back_sizes), torch.tensor(chunk_order(R, L, True)),
                       backend=backend)
    assert torch.equal(back, x)
    # 1-D (probs) and gradients.
    p = torch.randn(sum(sizes), dtype=torch.float64, requires_grad=True)
    assert torch.equal(sort_chunks(p, sizes, order, backend=backend),
                       _loop_sort_chunks(p, sizes, order))
    assert torch.autograd.gradcheck(lambda v: sort_chunks(v, sizes, order, backend=backend),
                                    (p,))
    empty = torch.zeros(0, 3)
    assert sort_chunks(empty, [0, 0], [1, 0], backend=backend).shape == (0, 3)


def test_chunk_order_inverse():
    for R, L in [(1, 1), (2, 3), (4, 2)]:
        fwd, inv = chunk_order(R, L), chunk_order(R, L, inverse=True)
        assert [fwd[i] for i in inv] == list(range(R * L))


# Compiles kernels for an H100 (sm_90) in a subprocess without the interpreter: no
# GPU is needed to run Triton's real code generation down to a cubin, and it fails
# on what the interpreter lets through (types, constexpr misuse, layouts).
_COMPILE_SCRIPT = """
import importlib, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
mod = importlib.import_module(sys.argv[1])
for name, signature, constants in json.loads(sys.argv[2]):
    fn = getattr(mod, name)
    full, constexprs = dict(signature), {}
    for key, value in constants.items():
        if isinstance(value, str):  # a dtype such as "float32"
            value = getattr(tl, value)
        constexprs[(fn.arg_names.index(key),)] = value
        full[key] = "constexpr"
    triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))
    print("compiled", name)
"""


def compile_for_sm90(module: str, specs: list) -> None:
    """specs: ``[kernel name, {arg: triton type}, {constexpr arg: value}]`` each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, module, json.dumps(specs)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == len(specs)


def test_kernels_compile_for_gpu():
    rows = {"index_ptr": "*i64", "scale_ptr": "*fp32", "dot_ptr": "*fp32", "num_src": "i32",
            "H": "i32", "stride_src": "i32", "stride_other": "i32", "stride_out": "i32"}
    specs = []
    for dtype in ("bf16", "fp32"):
        data = {"src_ptr": f"*{dtype}", "other_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
        for has_scale in (True, False):
            specs.append(["_gather_rows_kernel", {**rows, **data},
                          {"HAS_SCALE": has_scale, "HAS_DOT": has_scale, "ACC": "float32",
                           "BLOCK_H": 1024}])
            specs.append(["_sum_rows_kernel",
                          {"src_ptr": f"*{dtype}", "rows_ptr": "*i64", "row_ptr_ptr": "*i64",
                           "scale_ptr": "*fp32", "out_ptr": f"*{dtype}", "H": "i32",
                           "stride_src": "i32", "stride_out": "i32"},
                          {"HAS_SCALE": has_scale, "ACC": "float32", "BLOCK_H": 1024}])
    compile_for_sm90("moe_fold.kernels.permute_triton", specs)
