"""Fault injection for the reliability tests and the goodput bench (moe_fold/training/faults.py):
a FaultPlan parses its items and turns the named batch's or step's loss into NaN, inf or a spike,
and refuses an item it cannot read."""

import math

import pytest
import torch

from moe_fold.training.faults import SPIKE_FACTOR, Fault, FaultPlan


def test_fault_plan_parses_and_applies():
    plan = FaultPlan.parse(" nan@batch=5, spike@step=2,inf@step=3 ")
    assert plan.faults == (Fault("nan", "batch", 5), Fault("spike", "step", 2), Fault("inf", "step", 3))
    loss = torch.tensor(2.0)
    assert math.isnan(plan.apply(loss, step=9, batch=5).item())
    assert plan.apply(loss, step=2, batch=0).item() == 2.0 * SPIKE_FACTOR
    assert plan.apply(loss, step=3, batch=0).item() == math.inf
    assert plan.apply(loss, step=5, batch=2).item() == 2.0  # step 5 is not batch 5
    assert FaultPlan().faults == () and FaultPlan.parse("").faults == ()
    with pytest.raises(ValueError, match=r"--faults='nan@batch=5,oops': item 'oops' is not KIND@WHERE=N"):
        FaultPlan.parse("nan@batch=5,oops")
