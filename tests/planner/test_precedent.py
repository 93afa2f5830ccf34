"""The closest published precedent (moe_fold/planner/precedent.py): the measured run a plan
leans on, for an MoE and a dense plan; none without rows; a missing folder refused."""

import pytest


def test_closest_precedent_names_a_published_row():
    from moe_fold.config import load_config
    from moe_fold.planner.estimate import calibrated, estimate
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.precedent import closest, read_published, row_config

    rows = read_published()
    moe = estimate(load_config("mixtral-8x7b", ["parallel.tp=1", "parallel.pp=4", "parallel.ep=8"]), 64,
                   get_gpu("h100"), calibrated("h100"))
    assert closest(rows, moe, "h100")["id"] == "mcore08-mixtral-8x7b"
    dense = row_config(next(r for r in rows if r["id"] == "narayanan21-145.6b"))
    plan = estimate(dense, 1536, get_gpu("a100"), calibrated("a100"))
    assert closest(rows, plan, "a100")["id"] == "narayanan21-145.6b"
    assert closest([], plan, "a100") is None
    with pytest.raises(ValueError, match="not a folder"):
        read_published("/nonexistent/published")
