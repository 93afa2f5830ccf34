"""Token dispatchers against the single-process computation on the same global data.

Every rank builds the global tokens, probs and routing of all ranks from one seed and
dispatches its own slice; each expert is a different function of the global expert
index (``tanh(x @ A_e) @ B_e``, with the etp ranks of an expert each holding a shard of
its inner dim, so their partial outputs sum to the full one), applied with the probs as
the real experts do. Dispatch -> experts -> combine must equal the loop over tokens and
their experts written below, forward and backward (token and prob grads), for every
dispatcher and mode on 1, 2, 4 and 8 ranks with ep in {1, 2, 4, 8} and etp in {1, 2}:
bit for bit (``rtol=0, atol=0``) wherever the dispatcher adds a token's rows in the
reference's order, within the bound of :func:`summation_bound` where it cannot.
The asynchronous calls (``dispatch_start`` / ``combine_start``) must give the blocking
calls' results bit for bit, and the same bytes.
The bytes each rank sent must equal the counts worked out here from the global routing.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_fold.config import MoEConfig
from moe_fold.dispatch.allgather import AllGatherDispatcher
from moe_fold.dispatch.alltoall import AllToAllDispatcher
from moe_fold.dispatch.dispatcher import build_dispatcher
from moe_fold.dispatch.router import apply_capacity
from moe_fold.launch import RankError, run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups

H = 8  # hidden size
F = 4  # expert inner size, split over etp
ELEM = 4  # float32 bytes

# (dispatcher, mode, dedup) run on each kind of case.
DROPLESS = [("alltoall", "dropless", False), ("alltoall", "dropless", True), ("allgather", "dropless", False)]
CAPACITY = [("alltoall", "capacity", False), ("alltoall", "capacity", True),
            ("allgather", "capacity", False), ("alltoall", "pad", False)]


# ----------------------------------------------------------------- global data

@dataclasses.dataclass(frozen=True)
class Case:
    """One global routing problem. ``sizes[r]`` tokens on world rank r."""

    name: str
    sizes: tuple[int, ...]
    num_experts: int
    topk: int
    routing: str = "random"  # random | one_expert | router_pad
    capacity_factor: float | None = None
    seed: int = 0

    def capacity(self, num_tokens: int) -> int:
        return math.ceil(num_tokens * self.topk / self.num_experts * self.capacity_factor)


def expert_weights(e: int):
    gen = torch.Generator().manual_seed(1000 + e)
    return torch.randn(H, F, generator=gen) / H ** 0.5, torch.randn(F, H, generator=gen) / F ** 0.5


class OrderedMatmul(torch.autograd.Function):
    """``x @ w`` for a constant ``w``, as the left-to-right sum over k of ``x[:, k] *
    w[k]``: elementwise products and additions, each rounded once in IEEE float32 by any
    CPU, ISA or vector width, whatever the memory alignment; the backward is the same sum
    with ``w.t()``. No BLAS call: a GEMM's summation order is the library's choice (MKL's
    sgemm picks its kernel by CPU and by the operands' alignment), so it could differ
    between the dispatcher's rows and the reference's."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return ordered_sum(x, w)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return ordered_sum(grad, w.t()), None


def ordered_sum(x, w):
    out = x[:, :1] * w[:1]
    for k in range(1, w.shape[0]):
        out = out + x[:, k:k + 1] * w[k:k + 1]
    return out


def expert_fn(x, e, etp_rank=0, etp=1):
    """Expert e's output for rows x, from the etp shard ``etp_rank`` of its inner dim.
    One row at a time, and its products summed in a fixed order (:class:`OrderedMatmul`):
    a row's result then depends on that row alone, not on the rows that share its batch,
    their count or where they lie in memory, so the dispatchers and the reference see
    bit-identical expert rows on any machine."""
    a, b = expert_weights(e)
    shard = slice(etp_rank * F // etp, (etp_rank + 1) * F // etp)
    a, b = a[:, shard], b[shard]
    rows = [OrderedMatmul.apply(torch.tanh(OrderedMatmul.apply(row, a)), b) for row in x.split(1)]
    return torch.cat(rows) if rows else OrderedMatmul.apply(torch.tanh(OrderedMatmul.apply(x, a)), b)  # no row: x stays in the graph


def global_data(case: Case):
    """tokens [T, H], probs [T, E], routing_map [T, E], upstream grad [T, H] of all ranks."""
    gen = torch.Generator().manual_seed(case.seed)
    total, e = sum(case.sizes), case.num_experts
    tokens = torch.randn(total, H, generator=gen)
    scores = torch.randn(total, e, generator=gen)
    if case.routing == "one_expert":
        routing_map = torch.zeros(total, e, dtype=torch.bool)
        routing_map[:, e - 1] = True
    else:
        top = scores.topk(case.topk, dim=1).indices
        routing_map = torch.zeros(total, e, dtype=torch.bool).scatter_(1, top, True)
    # Probs are non-zero off the map too: the dispatcher must ignore them.
    probs = torch.softmax(scores, dim=1)
    if case.routing == "router_pad":
        # The router's own drop-and-pad: each expert gets exactly min(C, T) tokens per
        # rank, padded with unrouted tokens at prob 0.
        probs = probs * routing_map
        start = 0
        for t in case.sizes:
            mine = slice(start, start + t)
            probs[mine], routing_map[mine] = apply_capacity(
                probs[mine], routing_map[mine], case.capacity_factor, policy="probs",
                pad_to_capacity=True, topk=case.topk)
            start += t
    elif case.capacity_factor is not None:
        # Keep the first C tokens of each expert on each rank (the 'position' policy).
        start = 0
        for t in case.sizes:
            part = routing_map[start:start + t]
            part &= torch.cumsum(part.long(), dim=0) <= case.capacity(t)
            start += t
    grad = torch.randn(total, H, generator=gen)
    return tokens, probs, routing_map, grad


def reference(case: Case, etp: int = 1):
    """Output and (token, prob) grads computed in one process: for every expert in
    order, the rows of the tokens routed to it through the expert, weighted by their
    prob, added to their tokens; the token grads are added in the same order. Under etp
    the expert's row is the sum of its ``etp`` shards' weighted partial rows in shard
    order, as the etp reduction adds them. Also, in float64, the sum of the magnitudes of
    the terms added into each element of the output and of the token grads (each shard's
    partial row, or its grad), for :func:`summation_bound`."""
    tokens, probs, routing_map, grad = global_data(case)
    out, tokens_grad, probs_grad = torch.zeros_like(tokens), torch.zeros_like(tokens), torch.zeros_like(probs)
    out_terms, grad_terms = torch.zeros_like(tokens, dtype=torch.float64), torch.zeros_like(tokens, dtype=torch.float64)
    for e in range(case.num_experts):
        rows = routing_map[:, e].nonzero().flatten()
        xs, ps = tokens[rows].requires_grad_(True), probs[rows, e:e + 1].requires_grad_(True)
        partials = [expert_fn(xs, e, s, etp) * ps for s in range(etp)]
        y = sum(partials[1:], partials[0])
        xs_grad, ps_grad = torch.autograd.grad(y, (xs, ps), grad[rows], retain_graph=True)
        out.index_add_(0, rows, y.detach())
        tokens_grad.index_add_(0, rows, xs_grad)
        probs_grad[rows, e] = ps_grad[:, 0]
        for part in partials:
            (part_grad,) = torch.autograd.grad(part, xs, grad[rows], retain_graph=True)
            out_terms.index_add_(0, rows, part.detach().abs().double())
            grad_terms.index_add_(0, rows, part_grad.abs().double())
    return out, tokens_grad, probs_grad, out_terms, grad_terms


# ----------------------------------------------------------------- one rank's run

def make_dispatcher(kind, mode, dedup, case, groups, backend="torch"):
    cf = case.capacity_factor
    if kind == "alltoall":
        return AllToAllDispatcher(case.num_experts, case.topk, groups, mode=mode,
                                  capacity_factor=cf, dedup=dedup, permute_backend=backend)
    return AllGatherDispatcher(case.num_experts, case.topk, groups, mode=mode, permute_backend=backend)


def run_one(rank, case, groups, kind, mode, dedup, backend="torch", asynchronous=False):
    """Dispatch this rank's slice, run the experts, combine, backward; ``asynchronous``:
    through ``dispatch_start`` / ``combine_start``."""
    tokens, probs, routing_map, grad = global_data(case)
    start = sum(case.sizes[:rank])
    mine = slice(start, start + case.sizes[rank])
    x = tokens[mine].clone().requires_grad_(True)
    p = probs[mine].clone().requires_grad_(True)
    d = make_dispatcher(kind, mode, dedup, case, groups, backend)
    if asynchronous:
        out = d.dispatch_start(x, p, routing_map[mine]).wait()
    else:
        out = d.dispatch(x, p, routing_map[mine])
    counts = out.tokens_per_local_expert
    assert counts.dtype == torch.int64 and counts.device.type == "cpu"
    counts = counts.tolist()
    assert sum(counts) == out.tokens.shape[0] == out.probs.shape[0]
    etp_rank, etp = groups.rank_in("etp"), groups.size("etp")
    rows = [expert_fn(xs, d.local_expert_start + le, etp_rank, etp) * ps[:, None]
            for le, (xs, ps) in enumerate(zip(out.tokens.split(counts), out.probs.split(counts)))]
    y = d.combine_start(torch.cat(rows), out.handle).wait() if asynchronous else d.combine(torch.cat(rows), out.handle)
    assert y.shape == x.shape
    (y * grad[mine]).sum().backward()
    # numpy, not tensors: the launcher's queue would pass tensors as shared-memory
    # handles that die with the rank process.
    return {"y": y.detach().numpy(), "x_grad": x.grad.numpy(), "p_grad": p.grad.numpy(), "counts": counts,
            "tokens": out.tokens.detach().numpy(), "probs": out.probs.detach().numpy(),
            "wire": dataclasses.asdict(out.handle.wire)}


def configs_for(case):
    return DROPLESS if case.capacity_factor is None else CAPACITY


def rank_main(rank, world_size, plans):
    """``plans``: list of (layout kwargs, cases). Returns results[plan][case][config]."""
    results = []
    for layout_kw, cases in plans:
        groups = create_process_groups(ParallelLayout(world_size, **layout_kw))
        results.append([[run_blocking_and_async(rank, case, groups, cfg) for cfg in configs_for(case)] for case in cases])
    return results


def run_blocking_and_async(rank, case, groups, cfg, backend="torch"):
    """The blocking run's results, with the asynchronous run's under ``"async"``."""
    res = run_one(rank, case, groups, *cfg, backend=backend)
    res["async"] = run_one(rank, case, groups, *cfg, backend=backend, asynchronous=True)
    return res


# ----------------------------------------------------------------- expected numbers

def expected_wire(case, layout, rank, kind, mode, dedup):
    """Bytes ``rank`` sends, worked out from the global routing (see WireBytes)."""
    _, _, routing_map, _ = global_data(case)
    e_local = case.num_experts // layout.ep
    starts = [sum(case.sizes[:r]) for r in range(layout.world_size)]

    def tok(r):
        return routing_map[starts[r]:starts[r] + case.sizes[r]].view(-1, layout.ep, e_local)

    def ep_of(r):
        return layout.coords(r)["ep"]

    row = H * ELEM
    if kind == "allgather":
        group = layout.group_of("etp_ep", rank)
        return {"dispatch": case.sizes[rank] * (len(group) - 1) * row,
                "combine": (sum(case.sizes[q] for q in group) - case.sizes[rank]) * row,
                "dispatch_etp": 0, "combine_etp": 0}

    def sent_rows(r):  # rows r sends in its ep all-to-all, to each ep rank
        if mode == "pad":
            return [e_local * case.capacity(case.sizes[r])] * layout.ep
        per_rank = tok(r).any(dim=2) if dedup else tok(r)
        return [int(per_rank[:, j].sum()) for j in range(layout.ep)]

    def received_rows(r):  # rows r gets from its ep all-to-all (its own included)
        return sum(sent_rows(q)[ep_of(r)] for q in layout.group_of("ep", r))

    mine = sent_rows(rank)
    # Dispatch sends this rank's remote rows; combine sends back the remote rows it got.
    a2a_dispatch = (sum(mine) - mine[ep_of(rank)]) * row
    a2a_combine = sum(sent_rows(q)[ep_of(rank)] for q in layout.group_of("ep", rank) if q != rank) * row
    etp = len(layout.group_of("etp", rank))
    dispatch_etp = received_rows(rank) * (etp - 1) * row
    combine_etp = (sum(received_rows(q) for q in layout.group_of("etp", rank)) - received_rows(rank)) * row
    return {"dispatch": a2a_dispatch + dispatch_etp, "combine": a2a_combine + combine_etp,
            "dispatch_etp": dispatch_etp, "combine_etp": combine_etp}


def expected_meta(case, layout, rank, kind, mode, dedup, wire):
    """Bytes of everything but token rows: the count exchange (int64, all-gathered over
    etp x ep; none in the padded mode; the all-gather's carries the token count and the
    count per expert) and what travels with each row: its prob (plain and padded), its
    probs and map over the destination's experts (dedup), or its probs and map over all
    experts (all-gather)."""
    n = len(layout.group_of("etp_ep", rank))
    e, e_local = case.num_experts, case.num_experts // layout.ep
    if kind == "allgather":
        return (1 + e) * 8 * (n - 1) + case.sizes[rank] * (n - 1) * 2 * e * ELEM
    counts = 0 if mode == "pad" else (e + (layout.ep if dedup else 0)) * 8 * (n - 1)
    rows = wire["dispatch"] // (H * ELEM)
    return counts + rows * (2 * e_local if dedup else 1) * ELEM


def remote_pairs(case, layout, dedup):
    """The issue's count, a loop over every token of every rank: (token, expert) pairs
    whose expert lives on another ep rank, or with ``dedup`` distinct (token,
    destination ep rank) pairs. Each such pair crosses the wire once each way."""
    _, _, routing_map, _ = global_data(case)
    e_local = case.num_experts // layout.ep
    n, start = 0, 0
    for r, size in enumerate(case.sizes):
        me = layout.coords(r)["ep"]
        for t in range(start, start + size):
            owners = [e // e_local for e in routing_map[t].nonzero().flatten().tolist()]
            remote = [j for j in owners if j != me]
            n += len(set(remote)) if dedup else len(remote)
        start += size
    return n


def cat(arrays):
    return torch.cat([torch.from_numpy(a) for a in arrays])


U = 2.0 ** -24  # float32's unit roundoff


def summation_bound(layout, case, kind, mode, dedup, terms):
    """The largest difference allowed, element by element, between a dispatcher's output
    (or token grads) and the reference: 0 where it adds each token's rows in the
    reference's order. The all-gather dispatcher and dedup add a token's rows per rank of
    etp x ep first (its experts there, or its etp shard of each), then across ranks:
    another order than the reference's (each expert's shards, then the experts in order)
    once a token has more than two rows to add (top-k > 2, or etp > 1) on more than one
    rank. Both add the same n <= top-k x etp float32 terms (the experts' rows are the same
    bits: :func:`expert_fn`), and a float32 sum of n terms in any order is within
    gamma(n - 1) = (n - 1) u / (1 - (n - 1) u) times the sum of their magnitudes of the
    exact sum (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., (4.4)):
    two orders differ by at most twice that. ``terms``: the sum of the magnitudes, per
    element (float64, from :func:`reference`). Prob grads are exact everywhere."""
    grouped = (kind == "allgather" or dedup) and layout.etp * layout.ep > 1 and layout.etp * case.topk > 2
    if not grouped:
        return None
    n = case.topk * layout.etp
    return 2 * (n - 1) * U / (1 - (n - 1) * U) * terms


def assert_within(got, want, bound, what):
    """``got == want`` bit for bit where ``bound`` is None, else within ``bound`` element by
    element."""
    if bound is None:
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=what)
        return
    assert got.shape == want.shape == bound.shape, (what, got.shape, want.shape)
    if got.numel() == 0:
        return
    diff = (got.double() - want.double()).abs()
    worst = int((diff - bound).argmax())
    assert bool((diff <= bound).all()), (f"{what}: |difference| {diff.flatten()[worst].item():.3g} over its bound "
                                         f"{bound.flatten()[worst].item():.3g} at flat index {worst}")


def check_plan(world_size, plans, results):
    for (layout_kw, cases), plan_results in zip(plans, results):
        layout = ParallelLayout(world_size, **layout_kw)
        for ci, case in enumerate(cases):
            ref_y, ref_xg, ref_pg, y_terms, xg_terms = reference(case, layout.etp)
            starts = [sum(case.sizes[:r]) for r in range(world_size)]
            for k, cfg in enumerate(configs_for(case)):
                what = f"layout {layout_kw}, case {case.name}, {cfg}"
                per_rank = [results[r][plans.index((layout_kw, cases))][ci][k] for r in range(world_size)]
                y = cat([res["y"] for res in per_rank])
                assert_within(y, ref_y, summation_bound(layout, case, *cfg, y_terms), what)
                assert_within(cat([res["x_grad"] for res in per_rank]), ref_xg,
                              summation_bound(layout, case, *cfg, xg_terms), what)
                torch.testing.assert_close(cat([res["p_grad"] for res in per_rank]), ref_pg, atol=0, rtol=0, msg=what)
                _, _, routing_map, _ = global_data(case)
                for r, res in enumerate(per_rank):
                    # Rows per local expert: every routed pair of the etp x ep group (or C
                    # per source rank when padded).
                    group = layout.group_of("etp_ep", r)
                    e_local = case.num_experts // layout.ep
                    first = layout.coords(r)["ep"] * e_local
                    if cfg[1] == "pad":
                        want = [sum(case.capacity(case.sizes[q]) for q in group)] * e_local
                    else:
                        want = [sum(int(routing_map[starts[q]:starts[q] + case.sizes[q], first + le].sum())
                                    for q in group) for le in range(e_local)]
                    assert res["counts"] == want, (what, r)
                    wire = {key: res["wire"][key] for key in ("dispatch", "combine", "dispatch_etp", "combine_etp")}
                    assert wire == expected_wire(case, layout, r, *cfg), (what, r, res["wire"])
                    assert res["wire"]["meta"] == expected_meta(case, layout, r, *cfg, wire), (what, r, res["wire"])
                    # dispatch_start / combine_start: the same collectives in the same order.
                    for key in ("y", "x_grad", "p_grad", "tokens", "probs"):
                        assert (res["async"][key] == res[key]).all(), (what, r, key)
                    assert res["async"]["counts"] == res["counts"] and res["async"]["wire"] == res["wire"], (what, r)
                if cfg[0] == "alltoall" and cfg[1] != "pad" and layout.etp == 1:
                    want = remote_pairs(case, layout, dedup=cfg[2]) * H * ELEM
                    assert sum(res["wire"]["dispatch"] for res in per_rank) == want, what
                    assert sum(res["wire"]["combine"] for res in per_rank) == want, what
            # Every dispatcher hands the experts the same rows in the same order (the
            # padded mode adds empty rows, so it is compared through its outputs only).
            for r in range(world_size):
                runs = [res for cfg, res in zip(configs_for(case), results[r][plans.index((layout_kw, cases))][ci])
                        if cfg[1] != "pad"]
                for other in runs[1:]:
                    assert (other["tokens"] == runs[0]["tokens"]).all(), (layout_kw, case.name, r)
                    assert (other["probs"] == runs[0]["probs"]).all(), (layout_kw, case.name, r)


def cases_for(world_size, num_experts, seed):
    """Uneven token counts with an empty rank, all tokens to one expert, every rank
    empty, capacity dropping, the router's drop-and-pad, capacity 1."""
    gen = torch.Generator().manual_seed(seed)
    uneven = [int(v) for v in torch.randint(1, 10, (world_size,), generator=gen)]
    uneven[-1] = 0
    topk = min(2, num_experts)
    t = 6
    return [
        Case("uneven", tuple(uneven), num_experts, topk, seed=seed),
        Case("one_expert", tuple(3 + r for r in range(world_size)), num_experts, 1, "one_expert", seed=seed + 1),
        Case("all_empty", (0,) * world_size, num_experts, topk, seed=seed + 2),
        Case("capacity", (8,) * world_size, num_experts, topk, capacity_factor=1.0, seed=seed + 3),
        Case("router_pad", (5,) * world_size, num_experts, topk, "router_pad", capacity_factor=1.0, seed=seed + 5),
        # ceil(t * topk / E * cf) = ceil(0.5) = 1 row per expert and rank.
        Case("capacity_1", (t,) * world_size, num_experts, topk,
             capacity_factor=0.5 * num_experts / (t * topk), seed=seed + 4),
    ]


def run_matrix(world_size, layouts, timeout=240):
    plans = [(kw, cases_for(world_size, e, seed=11 * i + world_size)) for i, (kw, e) in enumerate(layouts)]
    results = run_ranks(rank_main, world_size, plans, timeout=timeout)
    check_plan(world_size, plans, results)


# ----------------------------------------------------------------- tests

def test_single_process_all_modes():
    groups = ProcessGroups.single_process()
    for num_experts in (1, 4):
        plans = [({}, cases_for(1, num_experts, seed=num_experts))]
        results = [[[run_blocking_and_async(0, case, groups, cfg) for cfg in configs_for(case)] for case in plans[0][1]]]
        check_plan(1, plans, [results])


def test_triton_permute_backend():
    # The Triton kernels run on the interpreter here: small shapes, one process.
    groups = ProcessGroups.single_process()
    cases = [Case("uneven", (7,), 4, 2, seed=3), Case("capacity", (6,), 4, 2, capacity_factor=1.0, seed=4)]
    results = [[[run_blocking_and_async(0, case, groups, cfg, "triton") for cfg in configs_for(case)] for case in cases]]
    check_plan(1, [({}, cases)], [results])


def test_one_gloo_rank():
    # Real process groups of size 1: the collectives must be skipped, not run.
    run_matrix(1, [(dict(ep=1), 4)])


def test_two_ranks():
    # ep 2; etp 2 (ep 1); ep 1 with edp 2 (each rank on its own).
    run_matrix(2, [(dict(ep=2), 4), (dict(ep=1, tp=2, etp=2), 2), (dict(ep=1), 2)])


def test_four_ranks():
    # One expert per rank; etp 2 x ep 2; ep 2 with edp 2.
    run_matrix(4, [(dict(ep=4), 4), (dict(ep=2, tp=2, etp=2), 4), (dict(ep=2), 4)])


@pytest.mark.slow
def test_eight_ranks():
    run_matrix(8, [(dict(ep=8), 16), (dict(ep=4, tp=2, etp=2), 8)], timeout=400)


def test_build_dispatcher_from_config():
    groups = ProcessGroups.single_process()
    d = build_dispatcher(MoEConfig(num_experts=4, topk=2), groups)
    assert isinstance(d, AllToAllDispatcher) and d.mode == "dropless" and not d.dedup
    d = build_dispatcher(MoEConfig(num_experts=4, topk=2, capacity_factor=1.5, pad_to_capacity=True), groups)
    assert d.mode == "pad" and d.capacity(10) == 8
    d = build_dispatcher(MoEConfig(num_experts=4, topk=2, capacity_factor=1.0, dedup=True), groups)
    assert d.mode == "capacity" and d.dedup
    d = build_dispatcher(MoEConfig(num_experts=4, topk=2, dispatcher="allgather"), groups)
    assert isinstance(d, AllGatherDispatcher)
    with pytest.raises(ValueError, match="moe.pad_to_capacity"):
        build_dispatcher(MoEConfig(pad_to_capacity=True), groups)
    with pytest.raises(ValueError, match="moe.dedup"):
        build_dispatcher(MoEConfig(dispatcher="allgather", dedup=True), groups)
    with pytest.raises(ValueError, match="moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got allgather"):
        build_dispatcher(MoEConfig(dispatcher="allgather", capacity_factor=1.0, pad_to_capacity=True), groups)
    with pytest.raises(ValueError, match="moe.dispatcher=x must be one of alltoall, allgather"):
        build_dispatcher(MoEConfig(dispatcher="x"), groups)
    with pytest.raises(ValueError, match="moe.dedup=true cannot run with moe.pad_to_capacity=true"):
        AllToAllDispatcher(4, 2, groups, mode="pad", capacity_factor=1.0, dedup=True)
    with pytest.raises(ValueError, match="needs capacity_factor"):
        AllToAllDispatcher(4, 2, groups, mode="capacity")
    with pytest.raises(ValueError, match="moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got allgather"):
        AllGatherDispatcher(4, 2, groups, mode="pad")


def test_bad_inputs_name_the_argument():
    d = AllToAllDispatcher(4, 2, ProcessGroups.single_process())
    x, p, m = torch.randn(3, H), torch.rand(3, 4), torch.zeros(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="routing_map must be a bool"):
        d.dispatch(x, p, m.float())
    with pytest.raises(ValueError, match="probs must be a float tensor of shape"):
        d.dispatch(x, p[:, :3], m)
    with pytest.raises(ValueError, match="tokens must be"):
        d.dispatch(x[0], p, m)
    m[0, 1] = True
    out = d.dispatch(x, p, m)
    with pytest.raises(ValueError, match=r"expert_output must be \[N=1, H\]"):
        d.combine(torch.randn(2, H), out.handle)
    with pytest.raises(RankError, match="moe.num_experts=3 is not divisible by parallel.ep=2"):
        run_ranks(_three_experts_on_two_ranks, 2, timeout=60)


def _three_experts_on_two_ranks(rank, world_size):
    AllToAllDispatcher(3, 2, create_process_groups(ParallelLayout(world_size, ep=2)))
