"""`moe-fold plan` (moe_fold/cli/plan.py): the JSON and the table of one layout's estimate, the
overlaps it assumes, the implementation whose footprint it prints, and its refusals."""

import json

from moe_fold.cli import main


def test_plan_command(capsys):
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--tp", "2", "--ep", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["tp"] == 2 and out["layout"]["dp"] == 2 and out["layout"]["edp"] == 1
    assert 0 < out["mfu"] < 1 and out["time"]["total"] > 0 and out["comm_bytes"]["ep"] > 0
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--tp", "2", "--ep", "2"]) == 0
    text = capsys.readouterr().out
    assert "MFU" in text and "activations" in text and "ep" in text
    # the config's overlaps (none by default), the switches, or Megatron's
    assert "overlaps assumed (moe-fold): none" in text
    base = ["plan", "--config", "mixtral-tiny", "--world", "4", "--ep", "2", "--distributed-optimizer"]
    assert main(base + ["--set", "parallel.overlap_grad_reduce=true", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overlaps"] == ["grad_reduce"] and out["overlap_model"] == "moe-fold"
    assert main(base + ["--overlap", "megatron"]) == 0
    assert "overlaps assumed (megatron): grad_reduce, param_gather" in capsys.readouterr().out
    assert "shared expert under the all-to-all off, 1 chunk(s)" in text
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--ep", "4", "--set", "moe.overlap_chunks=2"]) == 0
    assert "shared expert under the all-to-all off, 2 chunk(s)" in capsys.readouterr().out
    # mixtral has no shared expert to overlap
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--ep", "4",
                 "--set", "moe.shared_expert_overlap=true"]) == 2
    assert "moe.shared_expert_overlap=true needs a shared expert" in capsys.readouterr().err
    # 8 experts do not split over ep 3
    assert main(["plan", "--config", "mixtral-tiny", "--world", "6", "--ep", "3"]) == 2
    assert "moe.num_experts=8 is not divisible by parallel.ep=3" in capsys.readouterr().err
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--gpu", "tpu"]) == 2
    assert "gpu='tpu' is unknown" in capsys.readouterr().err


def test_plan_command_names_the_implementation(capsys):
    args = ["plan", "--config", "mixtral-tiny", "--world", "4", "--tp", "2", "--ep", "2"]
    assert main(args) == 0
    assert "moe-fold's footprint" in capsys.readouterr().out
    assert main(args + ["--implementation", "megatron"]) == 0
    assert "megatron's footprint" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # bf16 with masters: 2 + 4 bytes of weights per local parameter; of grads the float32
    # main grads' 4 (the bf16 grads die as they are made: tests/training/test_dryrun.py measures it)
    local = out["params"]["rank_max"]
    assert out["implementation"] == "moe-fold"
    assert out["memory"]["weights"] == 6 * local and out["memory"]["grads"] == 4 * local
    assert out["memory"]["master_weights"] == 4 * local
