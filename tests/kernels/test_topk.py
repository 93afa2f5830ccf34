"""Fused Triton router top-k against a loop reference (values, ties, gradients)."""

import math

import pytest
import torch

from moe_fold.kernels.topk_triton import topk_softmax_triton

MODES = [("softmax", False), ("softmax", True), ("sigmoid", False)]


def _loop_routing(logits, topk, score, pre_softmax):
    """Row by row from the definitions, in torch ops on single elements so autograd
    gives the reference gradient. Ties go to the lower expert index."""
    T, E = logits.shape
    probs = [[logits.new_zeros(()) for _ in range(E)] for _ in range(T)]
    rmap = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        row = [logits[t, e] for e in range(E)]
        if score == "sigmoid":
            scores = [1 / (1 + torch.exp(-v)) for v in row]
        elif pre_softmax:
            m = max(float(v.detach()) for v in row)
            ex = [torch.exp(v - m) for v in row]
            total = sum(ex)
            scores = [v / total for v in ex]
        else:
            scores = row
        chosen = sorted(range(E), key=lambda e: (-float(scores[e].detach()), e))[:topk]
        for e in chosen:
            rmap[t, e] = True
        if score == "sigmoid":
            total = sum(scores[e] for e in chosen) + 1e-20 if topk > 1 else 1.0
            for e in chosen:
                probs[t][e] = scores[e] / total
        elif pre_softmax:
            for e in chosen:
                probs[t][e] = scores[e]
        else:
            m = max(float(row[e].detach()) for e in chosen)
            ex = {e: torch.exp(row[e] - m) for e in chosen}
            total = sum(ex.values())
            for e in chosen:
                probs[t][e] = ex[e] / total
    return torch.stack([torch.stack(r) for r in probs]), rmap


@pytest.mark.parametrize("score,pre_softmax", MODES)
@pytest.mark.parametrize("E,topk", [(8, 2), (6, 1), (5, 5)])
def test_matches_loop_with_grads(score, pre_softmax, E, topk):
    g = torch.Generator().manual_seed(E * 10 + topk)
    logits0 = torch.randn(7, E, generator=g, dtype=torch.float64) * 2
    upstream = torch.randn(7, E, generator=g, dtype=torch.float64)

    logits = logits0.clone().requires_grad_()
    probs, rmap = topk_softmax_triton(logits, topk, score=score, pre_softmax=pre_softmax)
    (probs * upstream).sum().backward()

    ref_logits = logits0.clone().requires_grad_()
    ref_probs, ref_map = _loop_routing(ref_logits, topk, score, pre_softmax)
    (ref_probs * upstream).sum().backward()

    assert rmap.dtype == torch.bool and torch.equal(rmap, ref_map)
    assert torch.equal(rmap.sum(1), torch.full((7,), topk))
    torch.testing.assert_close(probs, ref_probs)
    torch.testing.assert_close(logits.grad, ref_logits.grad)


@pytest.mark.parametrize("score,pre_softmax", MODES)
def test_gradcheck(score, pre_softmax):
    logits = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    for topk in (1, 3):  # k = 1 has its own sigmoid branch
        assert torch.autograd.gradcheck(
            lambda x: topk_softmax_triton(x, topk, score=score, pre_softmax=pre_softmax)[0],
            (logits,))


def test_float32_and_bf16_logits_give_float32_probs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 8, generator=g)
    for x in (logits, logits.bfloat16()):
        probs, rmap = topk_softmax_triton(x, 2)
        assert probs.dtype == torch.float32
        ref, ref_map = _loop_routing(x.double(), 2, "softmax", False)
        assert torch.equal(rmap, ref_map)
        torch.testing.assert_close(probs.double(), ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(probs.sum(1), torch.ones(9))


def test_ties_pick_the_lower_expert_and_neg_inf():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0],
                           [0.0, 0.0, 0.0, 0.0],
                           [-math.inf, 2.0, -math.inf, 1.0]])
    probs, rmap = topk_softmax_triton(logits, 2)
    assert rmap.tolist() == [[False, True, True, False],
                             [True, True, False, False],
                             [False, True, False, True]]
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    # k = E picks every expert, -inf ones included, and they get prob 0.
    probs, rmap = topk_softmax_triton(logits[2:], 4)
    assert rmap.all()
    e = math.exp(1.0)
    torch.testing.assert_close(probs[0], torch.tensor([0.0, e / (e + 1), 0.0, 1 / (e + 1)]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="topk=5"):
        topk_softmax_triton(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="score='relu'"):
        topk_softmax_triton(torch.randn(2, 4), 2, score="relu")
    with pytest.raises(ValueError, match="pre_softmax=True needs"):
        topk_softmax_triton(torch.randn(2, 4), 2, score="sigmoid", pre_softmax=True)


@pytest.mark.parametrize("score,pre_softmax", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_as_router_torch_path(score, pre_softmax, dtype):
    """The issue's requirement: the kernel gives what dispatch/router.py's torch
    topk_routing gives, probs, map and logit gradients."""
    from moe_fold.dispatch.router import topk_routing

    g = torch.Generator().manual_seed(7)
    logits0 = torch.randn(16, 8, generator=g, dtype=dtype)
    upstream = torch.randn(16, 8, generator=g, dtype=dtype)
    for topk in (1, 2, 8):
        a = logits0.clone().requires_grad_()
        probs, rmap = topk_softmax_triton(a, topk, score=score, pre_softmax=pre_softmax)
        (probs * upstream).sum().backward()
        b = logits0.clone().requires_grad_()
        ref_probs, ref_map = topk_routing(b, topk, score=score, pre_softmax=pre_softmax)
        (ref_probs * upstream).sum().backward()
        assert probs.dtype == ref_probs.dtype
        assert torch.equal(rmap, ref_map)
        torch.testing.assert_close(probs, ref_probs)
        torch.testing.assert_close(a.grad, b.grad)


def test_kernels_compile_for_gpu():
    from tests.kernels.test_permute import compile_for_sm90

    specs = []
    for score, pre_softmax in MODES:
        for k in (1, 2):
            consts = {"K": k, "SIGMOID": score == "sigmoid", "PRE_SOFTMAX": pre_softmax,
                      "ACC": "float32", "BLOCK_E": 64}
            specs.append(["_topk_fwd_kernel",
                          {"logits_ptr": "*bf16", "probs_ptr": "*fp32", "map_ptr": "*i8",
                           "E": "i32", "stride_l": "i32", "stride_p": "i32", "stride_m": "i32"},
                          consts])
            specs.append(["_topk_bwd_kernel",
                          {"grad_ptr": "*fp32", "logits_ptr": "*bf16", "probs_ptr": "*fp32",
                           "map_ptr": "*i8", "grad_logits_ptr": "*bf16", "E": "i32",
                           "stride_g": "i32", "stride_l": "i32", "stride_p": "i32",
                           "stride_m": "i32", "stride_gl": "i32"}, consts])
    compile_for_sm90("moe_fold.kernels.topk_triton", specs)
