"""``moe-fold routes`` (moe_fold/cli/routes.py): the ``diff`` action's arguments and the
errors it exits 2 with; what the diff finds is in tests/core/test_routes.py."""

from __future__ import annotations

import pytest

from moe_fold.cli import main


def test_an_action_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main(["routes"])
    assert e.value.code == 2 and "ACTION" in capsys.readouterr().err


def test_two_runs_are_required():
    with pytest.raises(SystemExit) as e:
        main(["routes", "diff", "only-one"])
    assert e.value.code == 2


def test_runs_without_traces_exit_2_naming_the_folder(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert main(["routes", "diff", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-fold routes: error: ") and str(a) in err
