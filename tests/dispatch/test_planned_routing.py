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
