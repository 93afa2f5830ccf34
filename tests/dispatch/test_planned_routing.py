"""The planned routings of the dry run (dispatch/planned_routing.py): balanced, a starved ep
rank, one expert, Zipf, and the names they refuse."""

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
