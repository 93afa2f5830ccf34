"""The all-to-all dispatcher's own bookkeeping on two ep ranks, against counts and rows
worked out here from the global routing: the splits each rank sends and receives, the
rows each local expert gets (in ``[local expert][source rank]`` order), what dedup sends
(one row per token and destination rank) and the padded mode's fixed shapes. The
dispatch -> experts -> combine results of every dispatcher and mode against one process
are in tests/dispatch/test_dispatcher.py."""

from __future__ import annotations

import torch

from moe_fold.dispatch.alltoall import AllToAllDispatcher
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from tests.helpers.routing import random_routing

H, E, TOPK, EP = 4, 4, 2, 2
SIZES = (5, 3)  # tokens on each rank
EVEN = (4, 4)  # the padded mode needs as many tokens on every rank
PAD_CF = 2.0  # capacity ceil(4 * 2 / 4 * 2) = 4 rows: no routed token is dropped


def _global_routing(sizes):
    return random_routing(sum(sizes), H, E, TOPK, seed=7)


def _mine(rank, sizes, *tensors):
    start = sum(sizes[:rank])
    return [t[start:start + sizes[rank]] for t in tensors]


def _dispatch_rank(rank, world_size, mode, dedup, sizes):
    groups = create_process_groups(ParallelLayout(world_size, ep=EP))
    cf = None if mode == "dropless" else PAD_CF
    d = AllToAllDispatcher(E, TOPK, groups, mode=mode, capacity_factor=cf, dedup=dedup)
    tokens, probs, routing_map = _mine(rank, sizes, *_global_routing(sizes))
    out = d.dispatch(tokens, probs, routing_map)
    back = d.combine(out.tokens * out.probs[:, None], out.handle)
    h = out.handle
    return dict(input_splits=h.input_splits, output_splits=h.output_splits, rows=out.tokens, probs=out.probs,
                host_counts=out.host_tokens_per_local_expert, counts=out.tokens_per_local_expert.tolist(),
                combined=back, sent=h.wire.dispatch)


def _expected_rows(rank, tokens, probs, routing_map):
    """Rows of ep rank ``rank``'s experts: per local expert, per source rank, the routed
    tokens in token order; with their probs."""
    el = E // EP
    rows, row_probs = [], []
    for e in range(rank * el, (rank + 1) * el):
        for src in range(EP):
            t, p, m = _mine(src, SIZES, tokens, probs, routing_map)
            rows.append(t[m[:, e]])
            row_probs.append(p[m[:, e], e])
    return torch.cat(rows), torch.cat(row_probs)


def test_dropless_splits_rows_and_combine_on_two_ep_ranks():
    tokens, probs, routing_map = _global_routing(SIZES)
    el = E // EP
    results = run_ranks(_dispatch_rank, EP, "dropless", False, SIZES, timeout=120)
    for rank, r in enumerate(results):
        m = _mine(rank, SIZES, routing_map)[0]
        assert r["input_splits"] == [int(m[:, j * el:(j + 1) * el].sum()) for j in range(EP)]
        assert r["output_splits"] == [int(_mine(j, SIZES, routing_map)[0][:, rank * el:(rank + 1) * el].sum())
                                      for j in range(EP)]
        rows, row_probs = _expected_rows(rank, tokens, probs, routing_map)
        assert torch.equal(r["rows"], rows) and torch.equal(r["probs"], row_probs)
        assert r["counts"] == r["host_counts"] == [int(routing_map[:, e].sum()) for e in range(rank * el, (rank + 1) * el)]
        # Bytes on the wire: the rows this rank sent to the other ep rank.
        assert r["sent"] == r["input_splits"][1 - rank] * H * 4
        # Each token comes back as the prob-weighted sum of its own rows.
        t, p, mm = _mine(rank, SIZES, tokens, probs, routing_map)
        assert torch.allclose(r["combined"], t * (p * mm).sum(dim=1, keepdim=True), rtol=1e-6, atol=1e-6)


def test_dedup_sends_a_token_once_per_destination_rank_and_gives_the_plain_rows():
    routing_map = _global_routing(SIZES)[2]
    el = E // EP
    plain = run_ranks(_dispatch_rank, EP, "dropless", False, SIZES, timeout=120)
    dedup = run_ranks(_dispatch_rank, EP, "dropless", True, SIZES, timeout=120)
    for rank, (p, d) in enumerate(zip(plain, dedup)):
        m = _mine(rank, SIZES, routing_map)[0]
        assert d["input_splits"] == [int(m[:, j * el:(j + 1) * el].any(dim=1).sum()) for j in range(EP)]
        assert d["sent"] == d["input_splits"][1 - rank] * H * 4 < p["sent"]
        assert torch.equal(d["rows"], p["rows"]) and torch.equal(d["probs"], p["probs"])
        assert d["counts"] == p["counts"]
        assert torch.allclose(d["combined"], p["combined"], rtol=1e-6, atol=1e-6)


def test_pad_mode_gives_every_expert_capacity_rows_from_every_source():
    tokens, probs, routing_map = _global_routing(EVEN)
    el, t = E // EP, EVEN[0]
    c = int(t * TOPK / E * PAD_CF)
    results = run_ranks(_dispatch_rank, EP, "pad", False, EVEN, timeout=120)
    for rank, r in enumerate(results):
        assert r["input_splits"] is None and r["output_splits"] is None
        assert r["counts"] == r["host_counts"] == [c * EP] * el and r["rows"].shape == (el * EP * c, H)
        for le in range(el):
            e = rank * el + le
            for src in range(EP):
                m = routing_map[src * t:(src + 1) * t, e]
                block = slice((le * EP + src) * c, (le * EP + src + 1) * c)
                kept = int(m.sum())
                # The routed tokens in token order, then zero rows at prob 0.
                assert torch.equal(r["rows"][block][:kept], tokens[src * t:(src + 1) * t][m])
                assert torch.equal(r["probs"][block][:kept], probs[src * t:(src + 1) * t][m, e])
                assert torch.equal(r["rows"][block][kept:], torch.zeros(c - kept, H))
                assert torch.equal(r["probs"][block][kept:], torch.zeros(c - kept))
        # Each token comes back as the prob-weighted sum of its own rows.
        tt, p, mm = _mine(rank, EVEN, tokens, probs, routing_map)
        assert torch.allclose(r["combined"], tt * (p * mm).sum(dim=1, keepdim=True), rtol=1e-6, atol=1e-6)
