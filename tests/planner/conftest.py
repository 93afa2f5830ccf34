"""One training step on gloo ranks, shared by the planner's communication and parameter
tests (tests/planner/test_comm.py, test_model.py): run once for the session, not once per
file, since it starts four processes."""

import pytest

from moe_fold.launch import run_ranks

from tests.helpers.planner_cases import LAYOUTS, train_step


@pytest.fixture(scope="session")
def gloo_step():
    return run_ranks(train_step, 4, list(LAYOUTS), timeout=300)
