"""`moe-fold train` (moe_fold/cli/train.py): bad configs refused before any rank starts (with
the layout parallel.elastic=true would take), a run in one process printed and resumed, local
ranks spawned, and the help's examples. The training loop itself: tests/training/test_train.py."""

import pytest

from moe_fold import cli
from moe_fold.config import load_config
from moe_fold.training.train import read_metrics


def _refused(capsys, monkeypatch, argv: list[str]) -> str:
    def no_spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned for a bad config")
    monkeypatch.setattr("moe_fold.launch.run_ranks", no_spawn)
    assert cli.main(["train", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--config", "mixtral-tiny", "--nproc", "4", "--set", "parallel.ep=3"],
     "moe.num_experts=8 is not divisible by parallel.ep=3"),
    (["--config", "mixtral-tiny", "--nproc", "3"], "world_size=3 is not divisible by parallel.etp*ep*pp=2"),
    # The fix named: the layout parallel.elastic=true would take.
    (["--config", "mixtral-tiny", "--nproc", "2", "--set", "parallel.ep=4"],
     "world_size=2 is not divisible by parallel.etp*ep*pp=4 (etp=null -> tp=1, ep=4, pp=1); parallel.elastic=true "
     "would take largest ep (tp=1 cp=1 pp=1 ep=2 etp=1) here: dp=2, edp=1, 2 micro-batches per step"),
    (["--config", "mixtral-tiny", "--set", "moe.topk=9", "--nproc", "2"],
     "moe.topk=9 must be in [1, moe.num_experts=8]"),
    (["--config", "mixtral-tiny", "--set", "train.stepz=3"],
     "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    (["--config", "mixtral-tinyy"], "unknown preset 'mixtral-tinyy'; did you mean 'mixtral-tiny'?"),
    (["--config", "mixtral-tiny", "--nproc", "4", "--set", "optimizer.warmup_steps=1000"],
     "optimizer.warmup_steps=1000 must be <= train.steps=300"),
    (["--config", "mixtral-tiny", "--nproc", "0"], "--nproc=0 must be >= 1"),
])
def test_cli_refuses_bad_configs_before_spawning(capsys, monkeypatch, argv, message):
    err = _refused(capsys, monkeypatch, argv)
    assert message in " ".join(err.split()), err


def test_cli_under_a_restarted_torchrun_names_the_fitting_layout(capsys, monkeypatch):
    """A torchrun worker restarted in a smaller world (a node left) whose layout no longer
    fits: the error names the layout parallel.elastic=true would take, and says that
    torchrun restarted it in that world."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RESTART_COUNT", "1")):
        monkeypatch.setenv(name, value)
    err = " ".join(_refused(capsys, monkeypatch, ["--config", "mixtral-tiny", "--set", "parallel.ep=4"]).split())
    assert "parallel.elastic=true would take largest ep (tp=1 cp=1 pp=1 ep=2 etp=1) here" in err, err
    assert "torchrun restarted the workers (restart 1) in a world of 2 ranks: a node left or came back" in err, err


def test_cli_trains_and_resumes(tmp_path, cache_dir, capsys):
    """`moe-fold train` in one process: the config's changes to the preset (the --set
    overrides and the resolved kernel backends, not the whole config) and the layouts
    printed, a summary, then `--resume` continues the run folder from its checkpoint."""
    argv = ["train", "--config", "mixtral-tiny", "--no-progress", "--set", "parallel.ep=1", "--set", "model.seq_length=32",
            "--set", f"train.run_dir={tmp_path}", "--set", f"data.cache_dir={cache_dir}", "--set", "wandb.mode=disabled",
            "--set", "optimizer.warmup_steps=1"]
    assert cli.main(argv + ["--set", "train.steps=2"]) == 0
    printed = capsys.readouterr().out
    screen = printed.split("attention layout")[0].splitlines()
    changed = {line.split(":")[0].strip() for line in screen[1:]}
    assert screen[0] == f"config ({len(changed)} changed; all of it: {tmp_path}/config.yaml)", screen
    overridden = {a.split("=")[0] for a in argv if "=" in a} | {"train.steps"}
    assert overridden - {"parallel.ep"} <= changed  # mixtral-tiny has ep 2; 1 is a change
    assert changed - overridden <= {f"moe.{k}_backend" for k in ("gemm", "permute", "swiglu", "topk")}
    assert len(screen) == 1 + len(changed) and "num_experts" not in printed
    assert load_config(str(tmp_path / "config.yaml")).moe.num_experts == 8  # the whole config is in the run folder
    out = " ".join(printed.split())
    for text in ("attention layout tp=1 x cp=1 x dp=1 x pp=1 = 1 ranks",
                 "expert layout etp=1 x ep=1 x edp=1 x pp=1 = 1 ranks", "step 2/2 loss", "final loss",
                 f"checkpoint {tmp_path}/checkpoints/step_000002", "wandb disabled"):
        assert text in out, text
    assert cli.main(argv + ["--set", "train.steps=3", "--resume"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"resumed from {tmp_path}/checkpoints/step_000002" in out and "step 3/3 loss" in out
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow
def test_cli_spawns_local_ranks(tmp_path, cache_dir):
    """`moe-fold train --nproc 2`: two gloo ranks (ep 2) train and write the run folder.
    (Their output goes to the forkserver's stdout, which a test cannot always capture.)"""
    argv = ["train", "--config", "mixtral-tiny", "--nproc", "2", "--no-progress", "--set", "model.seq_length=32",
            "--set", f"train.run_dir={tmp_path}", "--set", f"data.cache_dir={cache_dir}", "--set", "wandb.mode=disabled",
            "--set", "optimizer.warmup_steps=1", "--set", "train.steps=2"]
    assert cli.main(argv) == 0
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert load_config(tmp_path / "config.yaml").parallel.ep == 2
    assert (tmp_path / "checkpoints" / "step_000002" / "index.json").is_file()


def test_cli_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "moe-fold train --config mixtral-tiny --nproc 4" in out and "--resume" in out and "torchrun" in out
