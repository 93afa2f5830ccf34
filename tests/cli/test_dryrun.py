"""`moe-fold dryrun` (moe_fold/cli/dryrun.py): the JSON and the table, one worker or two, and
its refusals. The dry run itself: tests/training/test_dryrun.py."""

import json

from moe_fold.cli import main


def test_command_prints_json_and_the_table(capsys):
    args = ["dryrun", "--config", "mixtral-tiny", "--world", "8", "--ep", "2", "--tp", "2", "--ranks", "0,7",
            "--jobs", "1"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Two worker processes trace the ranks between them: the same result.
    assert main(args + ["--json", "--jobs", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == out
    assert out["world"] == 8 and [r["rank"] for r in out["ranks"]] == [0, 7]
    assert out["layout"]["ep"] == 2 and out["layout"]["dp"] == 4
    for r in out["ranks"]:
        assert set(r["memory"]) == {"weights", "grads", "optimizer", "activations", "peak"}
        assert r["memory"]["peak"] >= r["memory"]["weights"] > 0 and r["params"] > 0
        assert {"op", "group", "size", "bytes"} <= set(r["collectives"][0])
    assert main(args + ["--gpu-gb", "0.001"]) == 0
    table = capsys.readouterr().out
    assert "fits" in table and "0.001" in table and " no " in table
    assert main(args + ["--routing", "uniform"]) == 2
    assert "routing='uniform' must be one of balanced" in capsys.readouterr().err
    assert main(args + ["--jobs", "0"]) == 2
    assert "--jobs=0 must be at least 1" in capsys.readouterr().err
