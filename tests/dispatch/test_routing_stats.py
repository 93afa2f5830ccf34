"""Load statistics of a routing decision (dispatch/routing_stats.py), by hand: the share
capacity dropped, max over mean load per expert and per ep rank, the edge cases a
logger meets (nothing routed, nothing kept) and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from moe_fold.dispatch.routing_stats import load_stats, routing_stats


def test_routing_stats_by_hand():
    routed = torch.tensor([6, 2, 0, 4])
    kept = torch.tensor([4, 2, 0, 4])
    s = routing_stats(routed, kept, ep=2)
    assert s.tokens_per_expert.tolist() == [4, 2, 0, 4]
    assert float(s.dropped_fraction) == pytest.approx(2 / 12)
    assert float(s.expert_load_ratio) == pytest.approx(4 / 2.5)
    # ep rank 0 holds experts 0-1 (6 kept), rank 1 experts 2-3 (4 kept): 6 / 5.
    assert float(s.ep_load_ratio) == pytest.approx(6 / 5)
    # One ep rank: the ratio over ranks is 1 whatever the experts' balance.
    one = routing_stats(routed, kept)
    assert float(one.ep_load_ratio) == 1.0 and float(one.expert_load_ratio) == pytest.approx(4 / 2.5)


def test_ep_ranks_hold_consecutive_experts():
    # Experts 0-1 on rank 0 and 2-3 on rank 1: perfectly balanced over ranks although the
    # experts are not; interleaved ranks (0, 2 | 1, 3) would read 2 / 1.5.
    kept = torch.tensor([3, 0, 1, 2])
    s = routing_stats(kept, kept, ep=2)
    assert float(s.ep_load_ratio) == 1.0 and float(s.dropped_fraction) == 0.0
    assert float(s.expert_load_ratio) == pytest.approx(3 / 1.5)


def test_nothing_routed_or_nothing_kept():
    zeros = torch.zeros(4, dtype=torch.int64)
    s = routing_stats(zeros, zeros, ep=2)
    assert (float(s.dropped_fraction), float(s.expert_load_ratio), float(s.ep_load_ratio)) == (0.0, 1.0, 1.0)
    dropped_all = routing_stats(torch.tensor([2, 1, 0, 1]), zeros, ep=4)
    assert (float(dropped_all.dropped_fraction), float(dropped_all.expert_load_ratio)) == (1.0, 1.0)


def test_load_stats_is_routing_stats_without_the_checks():
    routed, kept = torch.tensor([5, 1, 3, 3, 0, 4]), torch.tensor([4, 1, 3, 2, 0, 4])
    a, b = routing_stats(routed, kept, ep=3), load_stats(routed, kept, 3)
    for field in ("tokens_per_expert", "dropped_fraction", "expert_load_ratio", "ep_load_ratio"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("routed, kept, ep, message", [
    (torch.ones(4), torch.ones(4), 3, "ep=3"),
    (torch.ones(4), torch.ones(4), 0, "ep=0 must be >= 1"),
    (torch.ones(4), torch.ones(3), 1, r"routed \(4,\) and kept \(3,\) counts must both be \[experts\]"),
    (torch.ones(2, 2), torch.ones(2, 2), 1, r"routed \(2, 2\) and kept \(2, 2\) counts must both be \[experts\]"),
])
def test_bad_counts_are_refused_by_name(routed, kept, ep, message):
    with pytest.raises(ValueError, match=message):
        routing_stats(routed, kept, ep=ep)
