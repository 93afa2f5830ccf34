"""bf16 training on a GPU under torchrun (one worker, NCCL), and an exact resume: 6 steps
straight equal 3 steps (stopped by train.exit_at_step, with a checkpoint), a --resume
and 3 more, bit for bit (train.deterministic). Run by the gpu child process
(tests/helpers/gpu_support.py); skipped with the reason where no GPU is visible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_fold.training.train import read_metrics
from tests.training.test_train import SMALL

pytestmark = pytest.mark.gpu

from tests.helpers.paths import REPO as ROOT
GPU_BF16 = ["train.device=cuda", "parallel.backend=nccl", "train.precision=bf16", "train.deterministic=true",
            "train.steps=6", "optimizer.warmup_steps=2", "moe.z_loss_coeff=0.001"]


def _torchrun(run_dir: Path, cache_dir: str, *args: str) -> str:
    sets = [*SMALL, *GPU_BF16, f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "moe_fold.cli", "train", "--config", "mixtral-tiny", "--no-progress",
               *[a for s in sets for a in ("--set", s)], *args]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout + proc.stderr


def test_bf16_train_and_exact_resume_under_torchrun_nccl(tmp_path, cache_dir):
    _torchrun(tmp_path / "straight", cache_dir)
    _torchrun(tmp_path / "split", cache_dir, "--set", "train.exit_at_step=3")
    out = _torchrun(tmp_path / "split", cache_dir, "--resume")
    assert "resumed from" in out and "step_000003" in out
    whole, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 7)) == [r["step"] for r in whole]
    for a, b in zip(split, whole):
        assert (a["loss"], a["grad_norm"], a["expert_load"], a["lr"]) == \
            (b["loss"], b["grad_norm"], b["expert_load"], b["lr"]), a["step"]
    assert whole[-1]["lm_loss"] < whole[0]["lm_loss"]
