"""The planned routings of the dry run (dispatch/planned_routing.py): balanced, a starved ep
rank, one expert, Zipf, zero-computation experts, and the names they refuse."""

import numpy as np
import pytest

from moe_fold.dispatch.planned_routing import PlannedRouting, parse_routing


def test_routing_rules():
    balanced = PlannedRouting("balanced").assignment(10, 8, 2, 4, 0)
    assert balanced.shape == (10, 2) and all(len(set(row)) == 2 for row in balanced)
    counts = np.bincount(balanced.ravel(), minlength=8)
    assert counts.max() - counts.min() <= 1
    starved = parse_routing("starve-rank:2").assignment(10, 8, 2, 4, 0)
    assert not np.isin(starved, [4, 5]).any()
    one = parse_routing("one-expert").assignment(5, 8, 2, 4, 0)
    assert (one == [0, 1]).all()
    zipf = parse_routing("zipf:1.5").assignment(2000, 8, 2, 4, 3)
    z = np.bincount(zipf.ravel(), minlength=8)
    assert all(len(set(row)) == 2 for row in zipf) and z[0] > z[3] > z[7]
    for bad in ("uniform", "zipf:0", "starve-rank:x", "one-expert:2"):
        with pytest.raises(ValueError, match="must be one of balanced"):
            parse_routing(bad)
    with pytest.raises(ValueError, match="names ep rank 4, but ep=4"):
        parse_routing("starve-rank:4").assignment(4, 8, 2, 4, 0)


def test_zero_expert_slots_are_routed_but_not_counted():
    """With Z zero experts a rule picks among the held slots and the zero columns; the
    counts the dispatcher reads hold the held slots' rows only."""
    import torch

    rule = parse_routing("balanced").with_zero_experts(4)
    picks = rule.assignment(12, 8, 2, 4, 0)
    assert picks.max() == 11 and all(len(set(row)) == 2 for row in picks)
    assert np.bincount(picks.ravel(), minlength=12).tolist() == [2] * 12
    counts = rule(torch.zeros(4, 8, dtype=torch.long), "slots", 12, 2, 4, None)
    # 24 slots over 12 columns: 2 rows for each held slot, the 8 rows on zero experts not sent.
    assert counts == [[2] * 8] * 4
    by_rank = rule(torch.zeros(4, 12, dtype=torch.long), "slots+ranks", 12, 2, 4, None)[0]
    assert sum(by_rank[:8]) == 16 and len(by_rank) == 12
    starved = parse_routing("starve-rank:1").with_zero_experts(4).assignment(12, 8, 2, 4, 0)
    assert not np.isin(starved, [2, 3]).any() and np.isin(starved, [8, 9, 10, 11]).any()
    zipf = parse_routing("zipf:1.0").with_zero_experts(4).assignment(4000, 8, 2, 4, 1)
    assert np.isin(zipf, [8, 9, 10, 11]).any()


def _dense_counts(routing, num_tokens, num_slots, topk, ep, capacity, source):
    """The counts of one source rank from its whole [T, slots] routing map at once."""
    slots = routing.assignment(num_tokens, num_slots, topk, ep, source)
    routed = np.zeros((num_tokens, num_slots), dtype=bool)
    routed[np.arange(num_tokens)[:, None], slots] = True
    if capacity is not None:
        routed &= np.cumsum(routed, axis=0) <= capacity
    return routed.sum(axis=0).tolist() + routed.reshape(num_tokens, ep, -1).any(axis=2).sum(axis=0).tolist()


@pytest.mark.parametrize("rule", ["balanced", "one-expert", "starve-rank:1", "zipf:1.2"])
@pytest.mark.parametrize("capacity", [None, 9])
def test_counts_drawn_in_pieces_equal_the_whole_map(monkeypatch, rule, capacity):
    """Tokens are routed a piece at a time (7 here): the counts, capacity drops included,
    and Zipf's draws are those of the whole map."""
    import moe_fold.dispatch.planned_routing as planned

    whole = _dense_counts(parse_routing(rule), 50, 8, 2, 4, capacity, 3)
    zipf_whole = parse_routing("zipf:1.2").assignment(50, 8, 2, 4, 3)
    monkeypatch.setattr(planned, "CHUNK_TOKENS", 7)
    assert parse_routing(rule)._row("slots+ranks", 50, 8, 2, 4, capacity, 3) == whole
    assert np.array_equal(parse_routing("zipf:1.2").assignment(50, 8, 2, 4, 3), zipf_whole)


@pytest.mark.parametrize("rule", ["balanced", "zipf:1.2"])
def test_counts_at_full_size_hold_no_tokens_by_slots_map(rule):
    """128K tokens over 256 slots: the work arrays stay a piece of tokens by the slots,
    not the whole [T, slots] map (32 MB of bool; Zipf's float keys 8 times that)."""
    import tracemalloc

    tokens, slots = 1 << 17, 256
    tracemalloc.start()
    try:
        counts = parse_routing(rule)._row("slots+ranks", tokens, slots, 8, 8, None, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(counts[:slots]) == tokens * 8 and max(counts[slots:]) <= tokens
    assert peak < 16 << 20, peak
