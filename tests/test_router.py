"""Routing functions against loop references written here (one token or one expert at a
time, Python floats), not against the vectorised code."""

import math

import pytest
import torch

from moe_fold.dispatch.router import apply_capacity, expert_capacity, topk_routing, updated_expert_bias


# --------------------------------------------------------------------------- references

def ref_topk(logits, k, score="softmax", pre_softmax=False, num_groups=None, group_topk=None,
             scaling_factor=None, expert_bias=None):
    T, E = logits.shape
    probs = torch.zeros(T, E, dtype=torch.float64)
    rmap = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        row = [float(x) for x in logits[t]]
        if score == "softmax":
            m = max(row)
            ex = [math.exp(x - m) for x in row]
            sm = [e / sum(ex) for e in ex]
            sel = sm if pre_softmax else row
        else:
            sig = [1.0 / (1.0 + math.exp(-x)) for x in row]
            sel = [sig[i] + (float(expert_bias[i]) if expert_bias is not None else 0.0) for i in range(E)]
        eligible = list(range(E))
        if num_groups is not None:
            per = E // num_groups
            gscore = [sum(sorted(sel[g * per:(g + 1) * per], reverse=True)[:k // group_topk])
                      for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: (-gscore[g], g))[:group_topk]
            eligible = [i for i in range(E) if i // per in best]
        chosen = sorted(eligible, key=lambda i: (-sel[i], i))[:k]
        if score == "softmax" and pre_softmax:
            p = [sm[i] for i in chosen]
        elif score == "softmax":
            m = max(row[i] for i in chosen)
            ex = [math.exp(row[i] - m) for i in chosen]
            p = [e / sum(ex) for e in ex]
        else:
            p = [sig[i] for i in chosen]
            if k > 1:
                p = [x / sum(p) for x in p]
        if scaling_factor is not None:
            p = [x * scaling_factor for x in p]
        for i, x in zip(chosen, p):
            probs[t, i] = x
            rmap[t, i] = True
    return probs, rmap


def ref_capacity(probs, rmap, capacity_factor, policy, pad):
    T, E = probs.shape
    k = int(rmap[0].sum())
    cap = min(math.ceil((T * k / E) * capacity_factor), T)
    kept = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        routed = [t for t in range(T) if rmap[t, e]]
        if policy == "probs":
            routed.sort(key=lambda t: (-float(probs[t, e]), t))
        chosen = routed[:cap]
        if pad:
            chosen += [t for t in range(T) if not rmap[t, e]][:cap - len(chosen)]
        for t in chosen:
            kept[t, e] = True
    return probs * kept, kept


# --------------------------------------------------------------------------- top-k routing

ROUTING_CASES = [
    dict(score="softmax"),
    dict(score="softmax", pre_softmax=True),
    dict(score="sigmoid"),
    dict(score="softmax", num_groups=4, group_topk=2),
    dict(score="softmax", pre_softmax=True, num_groups=4, group_topk=2),
    dict(score="sigmoid", num_groups=4, group_topk=2),
    dict(score="softmax", scaling_factor=2.5),
    dict(score="sigmoid", scaling_factor=2.5, num_groups=2, group_topk=1),
    dict(score="sigmoid", bias=True),
    dict(score="sigmoid", bias=True, num_groups=4, group_topk=2, scaling_factor=1.5),
]


@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_topk_routing_matches_loop(case, k):
    case = dict(case)
    g = torch.Generator().manual_seed(k * 100 + len(ROUTING_CASES))
    T, E = 24, 16
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if case.pop("bias", False) else None
    if case.get("group_topk") and k % case["group_topk"]:
        case["group_topk"] = 1  # k=1 cannot split over 2 groups; one group keeps the case valid
    probs, rmap = topk_routing(logits, k, **case, expert_bias=bias)
    want_probs, want_map = ref_topk(logits, k, **case, expert_bias=bias)
    assert probs.dtype == torch.float32
    assert torch.equal(rmap, want_map)
    assert (rmap.sum(1) == k).all()
    torch.testing.assert_close(probs.double(), want_probs, rtol=1e-5, atol=1e-6)


def test_topk_routing_float64_logits_stay_float64():
    logits = torch.randn(8, 8, dtype=torch.float64)
    probs, rmap = topk_routing(logits, 2)
    want, want_map = ref_topk(logits, 2)
    assert probs.dtype == torch.float64 and torch.equal(rmap, want_map)
    torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-14)


def test_bias_changes_selection_not_probs():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    probs, rmap = topk_routing(logits, 2, score="sigmoid", expert_bias=bias)
    assert rmap.tolist() == [[True, False, False, True]]
    s0, s3 = 1 / (1 + math.exp(0.0)), 1 / (1 + math.exp(-3.0))
    torch.testing.assert_close(probs[0, [0, 3]].double(), torch.tensor([s0, s3], dtype=torch.float64) / (s0 + s3))


def test_group_limited_excludes_losing_groups():
    # Group 0 holds the single best expert but group 1 has the better top-2 sum.
    logits = torch.tensor([[5.0, -5.0, 3.0, 3.0]])
    _, rmap = topk_routing(logits, 2, num_groups=2, group_topk=1)
    assert rmap.tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("case", [dict(score="softmax"), dict(score="softmax", pre_softmax=True),
                                  dict(score="sigmoid"), dict(score="softmax", num_groups=2, group_topk=2)])
def test_ties_go_to_lower_index(case):
    # Every expert tied; then ties inside a row of integer logits.
    probs, rmap = topk_routing(torch.zeros(3, 8), 4, **case)
    assert rmap.tolist() == [[True] * 4 + [False] * 4] * 3
    torch.testing.assert_close(probs.double(), ref_topk(torch.zeros(3, 8), 4, **case)[0])
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0, 0.0, 2.0]])
    _, rmap = topk_routing(logits, 2, **case)
    assert torch.equal(rmap, ref_topk(logits, 2, **case)[1])
    assert rmap.nonzero()[:, 1].tolist() == [1, 2]


def test_tied_groups_go_to_lower_group():
    logits = torch.tensor([[1.0, 2.0, 2.0, 1.0, 0.0, 0.0]])
    _, rmap = topk_routing(logits, 2, num_groups=3, group_topk=1)
    assert rmap.nonzero()[:, 1].tolist() == [0, 1]


@pytest.mark.parametrize("case", [dict(score="softmax"), dict(score="softmax", pre_softmax=True),
                                  dict(score="sigmoid", scaling_factor=2.0),
                                  dict(score="sigmoid", bias=True, num_groups=2, group_topk=1)])
def test_topk_routing_gradient(case):
    case = dict(case)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(6, generator=g, dtype=torch.float64) if case.pop("bias", False) else None
    logits = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: topk_routing(x, 2, **case, expert_bias=bias)[0], (logits,))


@pytest.mark.parametrize("kwargs, match", [
    (dict(topk=9), "topk=9"),
    (dict(topk=0), "topk=0"),
    (dict(topk=2, score="relu"), "score='relu'"),
    (dict(topk=2, score="sigmoid", pre_softmax=True), "pre_softmax"),
    (dict(topk=2, expert_bias=torch.zeros(8)), "expert_bias needs score='sigmoid'"),
    (dict(topk=2, score="sigmoid", expert_bias=torch.zeros(7)), r"expert_bias must have shape \(8,\)"),
    (dict(topk=2, num_groups=3, group_topk=1), "num_groups=3"),
    (dict(topk=2, num_groups=4), "set together"),
    (dict(topk=3, num_groups=4, group_topk=2), "divisible by group_topk=2"),
    (dict(topk=2, num_groups=4, group_topk=5), "group_topk=5"),
    (dict(topk=6, num_groups=4, group_topk=2), "exceeds the 2 experts"),
    (dict(topk=2, scaling_factor=0.0), "scaling_factor=0.0"),
])
def test_topk_routing_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_routing(torch.randn(4, 8), **kwargs)


# --------------------------------------------------------------------------- capacity

@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.3, 8.0])
def test_apply_capacity_matches_loop(policy, pad, capacity_factor):
    g = torch.Generator().manual_seed(7)
    T, E, k = 20, 8, 2
    # Skewed logits overfill a few experts; quantised probs create ties between tokens.
    logits = torch.randn(T, E, generator=g) + torch.linspace(2, -2, E)
    probs, rmap = topk_routing(logits, k)
    probs = (probs * 4).round() / 4
    got_probs, got_map = apply_capacity(probs, rmap, capacity_factor, policy=policy, pad_to_capacity=pad)
    want_probs, want_map = ref_capacity(probs, rmap, capacity_factor, policy, pad)
    assert torch.equal(got_map, want_map)
    torch.testing.assert_close(got_probs, want_probs)
    cap = min(expert_capacity(T, E, k, capacity_factor), T)
    if pad:
        assert (got_map.sum(0) == cap).all()
    else:
        assert (got_map.sum(0) <= cap).all() and not (got_map & ~rmap).any()
    # topk read from the map gives the same answer as topk passed in.
    again = apply_capacity(probs, rmap, capacity_factor, policy=policy, pad_to_capacity=pad, topk=k)
    assert torch.equal(again[1], got_map)


def test_capacity_values_and_policies_by_hand():
    assert expert_capacity(10, 4, 2, 1.0) == 5
    assert expert_capacity(10, 4, 2, 1.1) == 6
    assert expert_capacity(7, 8, 1, 1.0) == 1
    # 4 tokens, 2 experts, k=1 -> capacity 2. Expert 0 gets tokens 0,1,2 (probs .6 .9 .9).
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.9, 0.0], [0.0, 0.7]])
    rmap = probs > 0
    assert apply_capacity(probs, rmap, 1.0, policy="probs")[1][:, 0].tolist() == [False, True, True, False]
    assert apply_capacity(probs, rmap, 1.0, policy="position")[1][:, 0].tolist() == [True, True, False, False]
    padded_probs, padded = apply_capacity(probs, rmap, 1.0, policy="position", pad_to_capacity=True)
    assert padded[:, 1].tolist() == [True, False, False, True]
    assert torch.equal(padded_probs[:, 1], probs[:, 1])


def test_capacity_keeps_gradient_of_kept_probs():
    logits = torch.randn(12, 4, requires_grad=True)
    probs, rmap = topk_routing(logits, 2)
    kept_probs, kept = apply_capacity(probs, rmap, 0.5)
    kept_probs.sum().backward()
    assert logits.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(capacity_factor=1.0, policy="random"), "policy='random'"),
])
def test_apply_capacity_bad_arguments(kwargs, match):
    probs, rmap = topk_routing(torch.randn(4, 8), 2)
    with pytest.raises(ValueError, match=match):
        apply_capacity(probs, rmap, **kwargs)


def test_apply_capacity_rejects_ragged_map():
    rmap = torch.tensor([[True, False], [True, True]])
    with pytest.raises(ValueError, match="different numbers of experts"):
        apply_capacity(rmap.float(), rmap, 1.0)


# --------------------------------------------------------------------------- expert bias

def test_updated_expert_bias_by_hand():
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0])
    counts = torch.tensor([10, 2, 4, 4])  # mean 5
    got = updated_expert_bias(bias, counts, 0.1)
    want = [b + 0.1 * (1 if 5 > c else -1 if 5 < c else 0) for b, c in zip(bias.tolist(), counts.tolist())]
    torch.testing.assert_close(got, torch.tensor(want))
    assert torch.equal(updated_expert_bias(bias, torch.full((4,), 3), 0.1), bias)
