"""``moe-fold checkpoint`` (moe_fold/cli/checkpoint.py): the ``verify`` action's argument,
which folders it takes as checkpoints (one step_* folder, or a run's finished ones, the
unfinished saves apart) and the exit status when there is none. Verifying the files
themselves is tests/training/test_checkpoint_verify.py."""

from __future__ import annotations

import pytest

from moe_fold.cli import main
from moe_fold.cli.checkpoint import _checkpoints


def _step(folder, name, finished=True):
    path = folder / name
    path.mkdir(parents=True)
    if finished:
        (path / "index.json").write_text("{}")
    return path


def test_a_run_folder_holds_its_finished_checkpoints_in_step_order(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    late, early = _step(checkpoints, "step_000020"), _step(checkpoints, "step_000010")
    partial = _step(checkpoints, "step_000030.tmp-1", finished=False)
    assert _checkpoints(tmp_path) == ([early, late], [partial])
    assert _checkpoints(late) == ([late], [])
    assert _checkpoints(tmp_path / "nowhere") == ([], [])


def test_no_checkpoint_exits_2_naming_where_it_looked(tmp_path, capsys):
    _step(tmp_path / "checkpoints", "step_000010.tmp-1", finished=False)
    assert main(["checkpoint", "verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-fold checkpoint: error: no checkpoint in {tmp_path}")
    assert str(tmp_path / "checkpoints") in err


def test_an_action_is_required():
    with pytest.raises(SystemExit) as e:
        main(["checkpoint"])
    assert e.value.code == 2
