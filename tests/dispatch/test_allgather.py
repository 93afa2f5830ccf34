"""The all-gather dispatcher's own bookkeeping on two ep ranks with uneven token counts,
against what is worked out here from the global routing: the gathered sizes, the rows
each local expert gets (every rank's tokens, in global token order), the counts on the
host and the device, the bytes on the wire, and combine's reduce-scatter back to the
token's own rank, blocking and asynchronous alike. The dispatch -> experts -> combine
results of every dispatcher and mode against one process are in
tests/dispatch/test_dispatcher.py."""

from __future__ import annotations

import pytest
import torch

from moe_fold.dispatch.allgather import AllGatherDispatcher
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from tests.helpers.routing import random_routing

H, E, TOPK, EP = 4, 4, 2, 2
SIZES = (5, 3)  # tokens on each rank


def _global_routing(sizes):
    return random_routing(sum(sizes), H, E, TOPK, seed=11)


def _mine(rank, *tensors):
    start = sum(SIZES[:rank])
    return [t[start:start + SIZES[rank]] for t in tensors]


def _dispatch_rank(rank, world_size, asynchronous):
    groups = create_process_groups(ParallelLayout(world_size, ep=EP))
    d = AllGatherDispatcher(E, TOPK, groups, mode="dropless")
    tokens, probs, routing_map = _mine(rank, *_global_routing(SIZES))
    if asynchronous:
        out = d.dispatch_start(tokens, probs, routing_map).wait()
        back = d.combine_start(out.tokens * out.probs[:, None], out.handle).wait()
    else:
        out = d.dispatch(tokens, probs, routing_map)
        back = d.combine(out.tokens * out.probs[:, None], out.handle)
    h = out.handle
    return dict(sizes=h.sizes, rows=out.tokens, probs=out.probs, host_counts=out.host_tokens_per_local_expert,
                counts=out.tokens_per_local_expert.tolist(), combined=back, wire=h.wire)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_gathered_rows_counts_wire_and_combine_on_two_ep_ranks(asynchronous):
    tokens, probs, routing_map = _global_routing(SIZES)
    el = E // EP
    results = run_ranks(_dispatch_rank, EP, asynchronous, timeout=120)
    for rank, r in enumerate(results):
        assert r["sizes"] == list(SIZES)
        experts = range(rank * el, (rank + 1) * el)
        # Per local expert, the routed tokens of every rank in global token order.
        assert torch.equal(r["rows"], torch.cat([tokens[routing_map[:, e]] for e in experts]))
        assert torch.equal(r["probs"], torch.cat([probs[routing_map[:, e], e] for e in experts]))
        assert r["counts"] == r["host_counts"] == [int(routing_map[:, e].sum()) for e in experts]
        # Every token goes to the other rank whatever its routing; the map travels as E
        # more columns beside the E probs, after one count exchange (the token count and
        # the pairs per expert, int64); combine sends back every row not this rank's.
        other = SIZES[1 - rank]
        assert (r["wire"].dispatch, r["wire"].meta, r["wire"].combine) == (
            SIZES[rank] * H * 4, SIZES[rank] * 2 * E * 4 + (1 + E) * 8, other * H * 4)
        # Each token comes back, on its own rank, as the prob-weighted sum of its rows.
        t, p, m = _mine(rank, tokens, probs, routing_map)
        assert torch.allclose(r["combined"], t * (p * m).sum(dim=1, keepdim=True), rtol=1e-6, atol=1e-6)


def test_one_process_keeps_every_pair_and_sends_nothing():
    d = AllGatherDispatcher(E, TOPK, ProcessGroups.single_process(), mode="capacity")
    tokens, probs, routing_map = _global_routing((6,))
    routing_map[0] = False  # a token the router dropped everywhere comes back as zero
    out = d.dispatch(tokens, probs, routing_map)
    assert out.host_tokens_per_local_expert == routing_map.sum(dim=0).tolist()
    back = d.combine(out.tokens * out.probs[:, None], out.handle)
    assert torch.allclose(back, tokens * (probs * routing_map).sum(dim=1, keepdim=True), rtol=1e-6, atol=1e-6)
    assert not back[0].any()
    assert (out.handle.wire.dispatch, out.handle.wire.meta, out.handle.wire.combine) == (0, 0, 0)


@pytest.mark.parametrize("mode, message", [
    ("pad", "moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got allgather"),
    ("dropall", "mode='dropall' must be one of"),
])
def test_modes_it_cannot_run_are_refused(mode, message):
    with pytest.raises(ValueError, match=message):
        AllGatherDispatcher(E, TOPK, ProcessGroups.single_process(), mode=mode)
