"""Routing functions against loop references written here (one token or one expert at a
time, Python floats), not against the vectorised code."""

import math

import pytest
import torch

from moe_fold.config import MoEConfig
from moe_fold.dispatch.router import (
    Router, apply_capacity, attach_loss, aux_loss_scores, expert_capacity, load_balancing_loss,
    topk_routing, updated_expert_bias, z_loss,
)
from moe_fold.layout import ProcessGroups

from tests.helpers.float64_reference import assert_close_to_float64


# --------------------------------------------------------------------------- references

def ref_topk(logits, k, score="softmax", pre_softmax=False, num_groups=None, group_topk=None,
             scaling_factor=None, expert_bias=None, group_score="topk_sum"):
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
            members = [sorted(sel[g * per:(g + 1) * per], reverse=True) for g in range(num_groups)]
            if group_score == "max":
                gscore = [m[0] for m in members]
            else:
                best_n = k // group_topk if group_score == "topk_sum" else 2
                gscore = [sum(m[:best_n]) for m in members]
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
    dict(score="softmax", num_groups=4, group_topk=2, group_score="top2_sum"),
    dict(score="sigmoid", bias=True, num_groups=4, group_topk=2, group_score="top2_sum"),
    dict(score="softmax", pre_softmax=True, num_groups=4, group_topk=2, group_score="max"),
    dict(score="sigmoid", bias=True, num_groups=4, group_topk=3, group_score="max"),
]


@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_topk_routing_matches_loop(case, k):
    case = dict(case)
    g = torch.Generator().manual_seed(k)
    T, E = 24, 16
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if case.pop("bias", False) else None
    if case.get("group_score", "topk_sum") == "topk_sum" and case.get("group_topk") and k % case["group_topk"]:
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


def test_softmax_bias_and_norm_min_as_ernie_routes():
    """ERNIE-4.5: the expert bias is added to the softmax over all experts for selection;
    the chosen softmax values are divided by max(their sum, norm_min). Against a loop."""
    gen = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(9, 8, generator=gen) * 2, torch.randn(8, generator=gen) * 0.1
    for norm_min in (None, 1e-12, 0.9):
        probs, rmap = topk_routing(logits, 3, pre_softmax=True, expert_bias=bias, norm_min=norm_min,
                                   scaling_factor=1.5)
        for t in range(9):
            soft = [math.exp(x) for x in logits[t].double().tolist()]
            soft = [x / sum(soft) for x in soft]
            chosen = sorted(range(8), key=lambda e: -(soft[e] + float(bias[e])))[:3]
            total = sum(soft[e] for e in chosen)
            scale = 1.0 if norm_min is None else max(total, norm_min)
            want = [soft[e] / scale * 1.5 if e in chosen else 0.0 for e in range(8)]
            assert rmap[t].nonzero().flatten().tolist() == sorted(chosen)
            torch.testing.assert_close(probs[t].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6,
                                       atol=1e-7)
    # The bias moves the choice away from the plain top-3 on some token.
    assert not torch.equal(rmap, topk_routing(logits, 3, pre_softmax=True)[1])


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


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_group_score_by_hand(group_score):
    # 3 groups of 3 experts; topk=3 from group_topk=2 groups (3/2 is not whole, which only
    # top2_sum and max allow).
    logits = torch.tensor([[9.0, 0.0, 0.0, 5.0, 5.0, 4.0, 6.0, 4.0, 0.0]])
    _, rmap = topk_routing(logits, 3, num_groups=3, group_topk=2, group_score=group_score)
    # top2_sum: groups 1 and 2 (10, 10 beat 9); the best 3 there are 6 (expert 6), 5 (3), 5 (4).
    # max: groups 0 and 2 (9 and 6 beat 5); the best 3 there are 9 (0), 6 (6), 4 (7).
    want = {"top2_sum": [3, 4, 6], "max": [0, 6, 7]}[group_score]
    assert rmap.nonzero()[:, 1].tolist() == sorted(want)
    assert torch.equal(rmap, ref_topk(logits, 3, num_groups=3, group_topk=2, group_score=group_score)[1])


def test_top2_sum_ranks_groups_on_biased_scores():
    # DeepSeek-V3 ranks groups on sigmoid + bias: the bias lifts group 1 over group 0.
    logits = torch.tensor([[3.0, 3.0, 0.0, 0.0, -3.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    _, rmap = topk_routing(logits, 1, score="sigmoid", num_groups=3, group_topk=1, group_score="top2_sum",
                           expert_bias=bias)
    assert rmap.nonzero()[:, 1].tolist() == [2]


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
    (dict(topk=2, score="relu"), "moe.score_function=relu must be one of softmax, sigmoid"),
    (dict(topk=2, score="sigmoid", pre_softmax=True), "pre_softmax"),
    (dict(topk=2, expert_bias=torch.zeros(8)), "moe.expert_bias=true requires moe.score_function=sigmoid"),
    (dict(topk=2, norm_min=1e-12), "moe.topk_norm_min=1e-12 requires moe.pre_softmax=true"),
    (dict(topk=2, pre_softmax=True, norm_min=0.0), "moe.topk_norm_min=0.0 must be a finite number > 0"),
    (dict(topk=2, score="sigmoid", expert_bias=torch.zeros(7)), r"expert_bias must have shape \(8,\)"),
    (dict(topk=2, num_groups=3, group_topk=1), "num_groups=3"),
    (dict(topk=2, num_groups=4), "must be both set or both null"),
    (dict(topk=3, num_groups=4, group_topk=2), "divisible by moe.group_topk=2"),
    (dict(topk=2, num_groups=4, group_topk=5), "group_topk=5"),
    (dict(topk=6, num_groups=4, group_topk=2), "moe.topk=6 exceeds the 4 experts in the selected groups"),
    (dict(topk=2, num_groups=4, group_topk=2, group_score="top3"), "moe.group_score=top3 must be one of"),
    (dict(topk=2, num_groups=8, group_topk=2, group_score="top2_sum"), "needs >= 2 experts per group"),
    (dict(topk=5, num_groups=4, group_topk=2, group_score="max"), "topk=5 exceeds the 4 experts"),
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
    (dict(capacity_factor=1.0, policy="random"), "moe.drop_policy=random must be one of probs, position"),
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


def test_updated_expert_bias_leaves_zero_experts_and_aims_held_ones_at_the_all_column_mean():
    """LongCat-Flash: the last zero_experts columns keep their bias; a held expert steps by
    the sign of (mean over every column - its count), so held experts above their share
    E / (E + Z) of the assignments fall even when they are below the held-only mean."""
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0, 0.25, -0.25])
    counts = torch.tensor([10, 2, 6, 5, 1, 0])  # mean over all 6 columns 4; over the 4 held 5.75
    got = updated_expert_bias(bias, counts, 0.1, zero_experts=2)
    want = [0.5 - 0.1, 0.0 + 0.1, -0.5 - 0.1, 0.0 - 0.1, 0.25, -0.25]
    torch.testing.assert_close(got, torch.tensor(want))


# --------------------------------------------------------------------------- losses

def ref_scores(logits, score):
    out = []
    for row in logits.tolist():
        if score == "softmax":
            m = max(row)
            ex = [math.exp(x - m) for x in row]
            out.append([e / sum(ex) for e in ex])
        else:
            s = [1 / (1 + math.exp(-x)) for x in row]
            out.append([x / sum(s) for x in s])
    return torch.tensor(out, dtype=torch.float64)


def ref_switch(scores, rmap, k, mask=None):
    """E * sum_i f_i P_i over the tokens where mask is True, one token at a time."""
    T, E = scores.shape
    tokens = [t for t in range(T) if mask is None or mask[t]]
    n = len(tokens)
    f = [sum(float(rmap[t, i]) for t in tokens) / (k * n) for i in range(E)]
    P = [sum(float(scores[t, i]) for t in tokens) / n for i in range(E)]
    return E * sum(fi * pi for fi, pi in zip(f, P))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_scores_match_loop(score):
    logits = torch.randn(6, 5)
    # float32 scores against the float64 loop: a few float32 ulps, not float64's default.
    assert_close_to_float64(aux_loss_scores(logits, score), ref_scores(logits, score), rtol=1e-6, atol=1e-7)


def test_load_balancing_loss_matches_loop():
    g = torch.Generator().manual_seed(11)
    T, E, k = 20, 6, 2
    logits = torch.randn(T, E, generator=g)
    scores = aux_loss_scores(logits)
    _, rmap = topk_routing(logits, k)
    mask = torch.rand(T, generator=g) > 0.3
    got = load_balancing_loss(scores, rmap.sum(0), T, k)
    assert abs(float(got) - ref_switch(scores, rmap, k)) < 1e-6
    got = load_balancing_loss(scores, (rmap & mask[:, None]).sum(0), int(mask.sum()), k, loss_mask=mask)
    assert abs(float(got) - ref_switch(scores, rmap, k, mask)) < 1e-6
    # Per sequence: 3 interleaved sequences, mean of each sequence's Switch loss.
    seq_ids = torch.arange(T) % 3
    counts = torch.stack([(rmap & (seq_ids == s)[:, None]).sum(0) for s in range(3)])
    lengths = torch.bincount(seq_ids, minlength=3)
    got = load_balancing_loss(scores, counts, lengths, k, seq_ids=seq_ids)
    want = sum(ref_switch(scores, rmap, k, (seq_ids == s).tolist()) for s in range(3)) / 3
    assert abs(float(got) - want) < 1e-6


def test_perfect_balance_gives_one():
    # Uniform scores and equal counts: E * sum_i (1/E)(1/E) = 1 whatever E, k.
    T, E, k = 16, 8, 2
    rmap = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        rmap[t, [t % E, (t + 1) % E]] = True
    assert abs(float(load_balancing_loss(torch.full((T, E), 1 / E), rmap.sum(0), T, k)) - 1.0) < 1e-6


def test_z_loss_matches_loop():
    logits = torch.randn(7, 5)
    mask = torch.tensor([True, False, True, True, False, True, True])
    lse2 = [math.log(sum(math.exp(x) for x in row)) ** 2 for row in logits.tolist()]
    assert abs(float(z_loss(logits)) - sum(lse2) / 7) < 1e-5
    assert abs(float(z_loss(logits, mask)) - sum(v for v, m in zip(lse2, mask) if m) / 5) < 1e-5
    assert abs(float(z_loss(logits, mask, 10)) - sum(v for v, m in zip(lse2, mask) if m) / 10) < 1e-5


def test_attach_loss_adds_scaled_gradient():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3)
    attach_loss(x * 2, (x ** 2).sum(), 0.25).mul(w).sum().backward()
    torch.testing.assert_close(x.grad, 2 * w + 0.25 * 2 * x.detach())


def test_loss_functions_bad_arguments():
    with pytest.raises(ValueError, match="score='tanh'"):
        aux_loss_scores(torch.randn(2, 3), "tanh")
    with pytest.raises(ValueError, match=r"tokens_per_expert must have shape \(3,\)"):
        load_balancing_loss(torch.rand(2, 3), torch.ones(4), 2, 1)
    with pytest.raises(ValueError, match="topk=4"):
        load_balancing_loss(torch.rand(2, 3), torch.ones(3), 2, 4)
    with pytest.raises(ValueError, match="must be a scalar"):
        attach_loss(torch.ones(2), torch.ones(2), 1.0)


# --------------------------------------------------------------------------- Router module

SINGLE = ProcessGroups.single_process()


def make_router(H=16, **moe):
    moe.setdefault("num_experts", 8)
    moe.setdefault("aux_loss_coeff", 0.0)
    torch.manual_seed(0)
    return Router(MoEConfig(**moe), H, SINGLE)


def reference_losses(W, h, cfg, mask=None, seq_ids=None, num_seqs=None):
    """Autograd reference from the formulas, token loops for counts and totals."""
    logits = h @ W.t()
    scores = torch.softmax(logits, -1) if cfg.score_function == "softmax" else \
        torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    rmap = ref_topk(logits.detach(), cfg.topk, score=cfg.score_function)[1]
    E, k, T = cfg.num_experts, cfg.topk, h.shape[0]
    tokens = [t for t in range(T) if mask is None or mask[t]]

    def switch(toks):
        if not toks:
            return torch.zeros(())
        counts = [sum(int(rmap[t, i]) for t in toks) for i in range(E)]
        return sum(scores[toks, i].sum() * counts[i] for i in range(E)) * E / (k * len(toks) ** 2)

    out = {"aux": switch(tokens)}
    if seq_ids is not None:
        out["seq_aux"] = sum(switch([t for t in tokens if seq_ids[t] == s]) for s in range(num_seqs)) / num_seqs
    out["z"] = sum(torch.logsumexp(logits[t], -1) ** 2 for t in tokens) / len(tokens)
    return logits, out


@pytest.mark.parametrize("score, extra", [
    ("softmax", {}), ("sigmoid", {}), ("softmax", dict(num_groups=4, group_topk=1, pre_softmax=True)),
    ("sigmoid", dict(num_groups=2, group_topk=2, expert_bias=True, scaling_factor=2.0)),
])
def test_router_losses_and_gradient_match_reference(score, extra):
    # With groups or bias the loss counts come from the plain top-k of the loss scores
    # (Megatron's choice), which the reference computes.
    cfg = dict(topk=2, score_function=score, aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.05, **extra)
    router = make_router(**cfg)
    bias = None
    if extra.get("expert_bias"):
        bias = torch.linspace(-1, 1, 8)
        router.expert_bias.copy_(bias)
    routing = {k: v for k, v in extra.items() if k != "expert_bias"}
    T = 12
    h = torch.randn(T, 16)
    mask = torch.ones(T, dtype=torch.bool)
    mask[[3, 7, 8]] = False
    seq_ids = torch.arange(T) % 3
    g = torch.randn(T, 8)
    hx = h.clone().requires_grad_(True)
    out = router(hx, loss_mask=mask, seq_ids=seq_ids, num_seqs=3)
    (out.probs * g).sum().backward()

    W = router.weight.detach().clone().requires_grad_(True)
    hr = h.clone().requires_grad_(True)
    logits, ref = reference_losses(W, hr, router, mask, seq_ids.tolist(), 3)
    probs, rmap = topk_routing(logits, 2, score=score, expert_bias=bias, **routing)
    total = (probs * g).sum() + 0.1 * ref["aux"] + 0.2 * ref["seq_aux"] + 0.05 * ref["z"]
    total.backward()
    assert torch.equal(out.routing_map, rmap)
    for name in ("aux", "seq_aux", "z"):
        assert float(out.losses[name]) == pytest.approx(float(ref[name].detach()), rel=1e-5), name
    torch.testing.assert_close(router.weight.grad, W.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hx.grad, hr.grad, rtol=1e-5, atol=1e-6)


def test_padding_is_the_same_as_absent_tokens():
    cfg = dict(topk=2, aux_loss_coeff=0.3, z_loss_coeff=0.1, global_aux_loss_coeff=0.2)
    h = torch.randn(10, 16)
    mask = torch.tensor([True, True, False, True, True, False, False, True, True, True])
    g = torch.randn(10, 8)
    a = make_router(**cfg)
    out_a = a(h, loss_mask=mask)
    (out_a.probs * g * mask[:, None]).sum().backward()
    b = make_router(**cfg)
    out_b = b(h[mask])
    (out_b.probs * g[mask]).sum().backward()
    for name in ("aux", "z", "global_aux"):
        assert float(out_a.losses[name]) == pytest.approx(float(out_b.losses[name]), rel=1e-6), name
    assert float(a.finish_step()["global_aux"]) == pytest.approx(float(b.finish_step()["global_aux"]), rel=1e-6)
    torch.testing.assert_close(a.weight.grad, b.weight.grad, rtol=1e-5, atol=1e-7)


def test_router_forward_is_topk_routing_then_capacity():
    """Router.forward wires its settings through: the expectation is the loop references
    above (ref_topk, ref_capacity), not the functions the router calls."""
    cfg = dict(topk=2, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0,
               capacity_factor=0.75, drop_policy="position", pad_to_capacity=True, router_dtype="float64")
    router = make_router(**cfg).eval()
    h = torch.randn(16, 16)
    out = router(h)
    logits = h.double() @ router.weight.double().t()
    probs, rmap = ref_topk(logits, 2, score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0)
    want_probs, want_map = ref_capacity(probs, rmap, 0.75, policy="position", pad=True)
    assert out.logits.dtype == torch.float64 and out.probs.dtype == torch.float64
    assert torch.equal(out.routing_map, want_map)
    torch.testing.assert_close(out.probs, want_probs)
    assert out.tokens_per_expert.tolist() == want_map.sum(0).tolist()
    assert out.losses == {}
    assert float(out.stats.dropped_fraction) == pytest.approx(1 - float((want_map & rmap).sum()) / 32)


def test_input_jitter_multiplies_hidden_in_training_only():
    router = make_router(topk=2, input_jitter=0.1)
    h = torch.randn(6, 16)
    torch.manual_seed(5)
    out = router(h)
    torch.manual_seed(5)
    noise = torch.empty_like(h).uniform_(0.9, 1.1)
    torch.testing.assert_close(out.logits, (h * noise) @ router.weight.t())
    torch.testing.assert_close(router.eval()(h).logits, h @ router.weight.t())


def test_global_aux_value_does_not_depend_on_microbatch_count():
    cfg = dict(topk=2, global_aux_loss_coeff=0.5, aux_loss_coeff=0.0)
    h = torch.randn(16, 16)
    values = []
    for m in (1, 2, 4):
        router = make_router(**cfg)
        for chunk in h.chunk(m):
            router(chunk)
        values.append(float(router.finish_step()["global_aux"]))
    whole = make_router(topk=2, aux_loss_coeff=1.0)(h).losses["aux"]
    assert values == pytest.approx([float(whole)] * 3, rel=1e-6)
    # The accumulation was reset: the next step starts from nothing.
    router(h[:4])
    assert float(router.finish_step()["global_aux"]) == pytest.approx(
        float(make_router(topk=2, aux_loss_coeff=1.0)(h[:4]).losses["aux"]), rel=1e-6)


def test_global_aux_gradient_uses_running_counts():
    cfg = dict(topk=2, global_aux_loss_coeff=0.5)
    h = torch.randn(12, 16)
    router = make_router(**cfg)
    for chunk in h.chunk(2):
        router(chunk, loss_scale=0.5).probs.sum().backward()
    W = router.weight.detach().double().requires_grad_(True)  # the reference in float64
    seen = []
    for chunk in h.double().chunk(2):
        logits = chunk @ W.t()
        scores = torch.softmax(logits, -1)
        rmap = ref_topk(logits.detach(), 2)[1]
        seen.append(rmap.sum(0).double())
        running = sum(seen) / len(seen)
        loss = 8 * (scores.sum(0) * running).sum() / (2 * 6 ** 2)
        (0.5 * (topk_routing(logits, 2)[0].sum() + 0.5 * loss)).backward()
    assert_close_to_float64(router.weight.grad, W.grad)


def test_loss_scale_averages_microbatches_like_one_batch():
    # aux on two micro-batches with loss_scale 1/2 = the mean of their two gradients.
    h = torch.randn(12, 16)
    router = make_router(topk=2, aux_loss_coeff=0.3)
    for chunk in h.chunk(2):
        (0.5 * router(chunk, loss_scale=0.5).probs.sum()).backward()
    grads = []
    for chunk in h.chunk(2):
        r = make_router(topk=2, aux_loss_coeff=0.3)
        r(chunk).probs.sum().backward()
        grads.append(r.weight.grad)
    torch.testing.assert_close(router.weight.grad, (grads[0] + grads[1]) / 2)


def test_expert_bias_update_and_padding_excluded():
    router = make_router(topk=2, score_function="sigmoid", expert_bias=True, bias_update_rate=0.01,
                         aux_loss_coeff=0.0)
    h = torch.randn(20, 16)
    mask = torch.arange(20) < 15
    out1 = router(h[:10], loss_mask=mask[:10])
    out2 = router(h[10:], loss_mask=mask[10:])
    counts = out1.routing_map[mask[:10]].sum(0) + out2.routing_map[mask[10:]].sum(0)
    mean = float(counts.sum()) / 8
    want = [0.01 * (1 if mean > c else -1 if mean < c else 0) for c in counts.tolist()]
    assert router.finish_step() == {}
    torch.testing.assert_close(router.expert_bias, torch.tensor(want))
    # Counts were cleared: an update with no forward in between changes nothing.
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor(want))
    # The bias now steers selection: a huge bias on expert 5 puts it in every token's top-k.
    router.expert_bias.fill_(0)[5] = 100.0
    out = router(h)
    assert out.routing_map[:, 5].all()
    logits = h @ router.weight.t()
    torch.testing.assert_close(out.probs.detach(), topk_routing(logits, 2, score="sigmoid",
                                                                expert_bias=router.expert_bias)[0])
    assert "expert_bias" in router.state_dict() and "_bias_counts" not in router.state_dict()


def test_no_losses_or_counts_outside_training_or_grad():
    router = make_router(topk=2, aux_loss_coeff=0.1, global_aux_loss_coeff=0.1, z_loss_coeff=0.1)
    h = torch.randn(8, 16)
    with torch.no_grad():
        assert router(h).losses == {}
    assert router.eval()(h).losses == {}
    assert router.finish_step() == {}


@pytest.mark.parametrize("moe, match", [
    (dict(topk=9), "topk=9"),
    (dict(score_function="relu"), "moe.score_function=relu must be one of softmax, sigmoid"),
    (dict(num_groups=3, group_topk=1), "num_groups=3"),
    (dict(expert_bias=True), "moe.expert_bias=true requires moe.score_function=sigmoid"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(capacity_factor=1.0, drop_policy="random"), "moe.drop_policy=random must be one of probs, position"),
    (dict(router_dtype="bfloat16"), "moe.router_dtype=bfloat16 must be one of float32, float64"),
    (dict(aux_loss_coeff=-1.0), "moe.aux_loss_coeff=-1.0"),
    (dict(input_jitter=float("nan")), "moe.input_jitter=nan"),
])
def test_router_bad_config(moe, match):
    with pytest.raises(ValueError, match=match):
        make_router(**moe)


def test_router_bad_inputs():
    router = make_router(topk=2, seq_aux_loss_coeff=0.1)
    with pytest.raises(ValueError, match=r"hidden must be \[tokens, 16\]"):
        router(torch.randn(4, 15))
    with pytest.raises(ValueError, match="loss_mask must be a bool"):
        router(torch.randn(4, 16), loss_mask=torch.ones(4))
    with pytest.raises(ValueError, match="needs seq_ids and num_seqs"):
        router(torch.randn(4, 16))
    with pytest.raises(ValueError, match="needs moe.expert_bias=True"):
        router.update_expert_bias()


def test_bf16_model_keeps_router_state_exact():
    router = make_router(topk=2, score_function="sigmoid", expert_bias=True, global_aux_loss_coeff=0.1)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32 and router._bias_counts.dtype == torch.float64
    assert router._ga_counts.dtype == torch.float64
    h = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    out = router(h)
    assert out.logits.dtype == torch.float32 and out.probs.dtype == torch.float32
    out.probs.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and router.weight.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------- the Triton top-k

FUSABLE = [dict(score="softmax"), dict(score="softmax", pre_softmax=True), dict(score="sigmoid"),
           dict(score="softmax", scaling_factor=2.5), dict(score="sigmoid", scaling_factor=1.5)]


TRITON_TOPK_CASES = ([(case, k, torch.float32) for case in FUSABLE for k in (1, 2, 4)]
                     + [(case, 2, torch.float64) for case in FUSABLE])


@pytest.mark.parametrize("case, k, dtype", TRITON_TOPK_CASES,
                         ids=["-".join([f"k={k}", str(t)[6:]] + [f"{a}={b}" for a, b in c.items()])
                              for c, k, t in TRITON_TOPK_CASES])
def test_triton_topk_equals_the_torch_path(case, k, dtype, monkeypatch):
    """backend='triton' (the fused kernel, interpreted on CPU) against 'torch': the same
    experts, ties included, and the same probs and logit gradients within float rounding."""
    kernel_calls = _count_kernel_calls(monkeypatch)
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(20, 12, generator=g, dtype=dtype) * 2
    logits[:4] = torch.randint(-2, 3, (4, 12), generator=g).to(dtype)  # rows full of ties
    grad = torch.randn(20, 12, generator=g, dtype=dtype)
    out = {}
    for backend in ("torch", "triton"):
        x = logits.clone().requires_grad_(True)
        probs, rmap = topk_routing(x, k, **case, backend=backend)
        (probs * grad).sum().backward()
        out[backend] = probs.detach(), rmap, x.grad
    (p_torch, m_torch, g_torch), (p_triton, m_triton, g_triton) = out["torch"], out["triton"]
    assert kernel_calls == [1]
    assert torch.equal(m_triton, m_torch)
    assert p_triton.dtype == p_torch.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(p_triton, p_torch, **tol)
    torch.testing.assert_close(g_triton, g_torch, **tol)


def _count_kernel_calls(monkeypatch) -> list:
    from moe_fold.kernels import topk_triton

    calls, kernel = [], topk_triton.topk_softmax_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(topk_triton, "topk_softmax_triton", counted)
    return calls


def test_router_with_the_triton_topk_equals_torch(monkeypatch):
    kernel_calls = _count_kernel_calls(monkeypatch)
    cfg = dict(topk=2, aux_loss_coeff=0.1, z_loss_coeff=0.05, scaling_factor=2.0)
    h, g = torch.randn(12, 16), torch.randn(12, 8)
    results = []
    for backend in ("torch", "triton"):
        router = make_router(**cfg, topk_backend=backend)
        hx = h.clone().requires_grad_(True)
        out = router(hx)
        (out.probs * g).sum().backward()
        results.append((out, router.weight.grad, hx.grad))
    (a, wa, ha), (b, wb, hb) = results
    assert kernel_calls == [1]
    assert torch.equal(a.routing_map, b.routing_map)
    torch.testing.assert_close(b.probs, a.probs, rtol=1e-6, atol=1e-7)
    for name in ("aux", "z"):
        torch.testing.assert_close(b.losses[name], a.losses[name])
    torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-7)


def test_topk_backend_choice():
    from moe_fold.kernels.topk import resolve_backend

    assert resolve_backend("auto", torch.zeros(2, 4)) == "torch"  # CPU: the interpreter is never chosen
    assert resolve_backend("triton", torch.zeros(2, 4)) == "triton"
    with pytest.raises(ValueError, match="'triton' fuses plain top-k only"):
        topk_routing(torch.zeros(2, 4), 2, num_groups=2, group_topk=1, backend="triton")
    with pytest.raises(ValueError, match="'triton' fuses plain top-k only"):
        topk_routing(torch.zeros(2, 4), 2, score="sigmoid", expert_bias=torch.zeros(4), backend="triton")
    with pytest.raises(ValueError, match="backend='fused' is not one of"):
        topk_routing(torch.zeros(2, 4), 2, backend="fused")
    with pytest.raises(ValueError, match="moe.topk_backend=triton fuses plain top-k only"):
        make_router(topk=2, score_function="sigmoid", expert_bias=True, topk_backend="triton")
