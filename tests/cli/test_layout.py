"""``moe-fold layout`` (moe_fold/cli/layout.py): its flags, the two layouts and their
groups it prints, and an impossible layout refused with the rule it breaks (exit 2)."""

from __future__ import annotations

import re

import pytest

from moe_fold.cli import main


def _groups(out: str, kind: str) -> str:
    """The groups column of ``kind``'s row in the printed tables."""
    (row,) = [line for line in out.splitlines() if re.match(rf"\W*{kind}\s", line)]
    return row.split("│")[3].strip()


def test_two_layouts_and_their_groups(capsys):
    assert main(["layout", "--world", "8", "--tp", "2", "--ep", "2", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    assert "world 8, order tp-cp-ep-dp-pp" in out
    assert "attention layout: tp 2 x cp 1 x dp 4 x pp 1 = 8" in out
    assert "expert layout: etp 1 x ep 2 x edp 4 x pp 1 = 8" in out
    assert _groups(out, "tp") == "{0,1} {2,3} {4,5} {6,7}"
    assert _groups(out, "ep") == "{0,1} {2,3} {4,5} {6,7}"
    assert _groups(out, "edp") == "{0,2,4,6} {1,3,5,7}"


def test_etp_defaults_to_tp_and_order_moves_the_fastest_size(capsys):
    assert main(["layout", "--world", "4", "--tp", "2", "--ep", "2", "--order", "ep-tp-cp-dp-pp"]) == 0
    out = capsys.readouterr().out
    assert "expert layout: etp 2 x ep 2 x edp 1 x pp 1 = 4" in out
    # ep varies fastest in the expert layout: consecutive ranks are ep neighbours and the
    # etp pairs stride 2; the attention layout has no ep, so tp stays fastest there.
    assert _groups(out, "ep") == "{0,1} {2,3}" and _groups(out, "etp") == "{0,2} {1,3}"
    assert _groups(out, "tp") == "{0,1} {2,3}"


@pytest.mark.parametrize("flags, message", [
    (["--world", "6", "--tp", "4"], "world_size=6 is not divisible by parallel.tp*cp*pp=4"),
    (["--world", "4", "--ep", "2", "--order", "tp-cp-dp-pp"], "order='tp-cp-dp-pp' leaves out 'ep' but ep=2"),
])
def test_an_impossible_layout_names_the_rule_and_exits_2(flags, message, capsys):
    assert main(["layout", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("moe-fold layout: error: ") and message in captured.err
    assert captured.out == ""


def test_world_is_required():
    with pytest.raises(SystemExit) as e:
        main(["layout", "--tp", "2"])
    assert e.value.code == 2
