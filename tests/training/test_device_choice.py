"""Where a rank computes (train.device, compute_device) and what follows from it: glibc's
malloc policy (keep_freed_memory) for CPU ranks only. On this CPU host CUDA is made to
look present by patching torch.cuda.is_available: the choice is pure logic."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moe_fold import cli, launch
from moe_fold.config import ConfigError, load_config
from moe_fold.training import train as train_module
from moe_fold.training.train import compute_device


def _config(*overrides):
    return load_config("mixtral-tiny", ["wandb.mode=disabled", *overrides])


@pytest.mark.parametrize("device, backend, cuda, expected", [
    ("auto", "auto", False, "cpu"),
    ("auto", "auto", True, "cuda:0"),
    ("auto", "gloo", True, "cpu"),  # gloo: the CPU path, whatever the host has
    ("cpu", "auto", True, "cpu"),  # the tests' choice: CI's results on a GPU host
    ("cuda", "auto", True, "cuda:0"),
    ("cuda", "nccl", True, "cuda:0"),
])
def test_single_process_device(monkeypatch, device, backend, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert compute_device(_config(f"train.device={device}", f"parallel.backend={backend}")) == torch.device(expected)


def test_local_rank_picks_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert compute_device(_config("train.device=cuda")) == torch.device("cuda", 3)


def test_cuda_without_a_gpu_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"train.device=cuda needs CUDA, but torch.cuda.is_available\(\) is False "
                                          r"\(torch 2\.13\.0"):
        compute_device(_config("train.device=cuda"))


@pytest.mark.parametrize("device, backend, message", [
    ("auto", "gloo", None), ("auto", "nccl", None), ("cpu", "gloo", None),
    ("cpu", "nccl", "train.device=cpu computes on the CPU, but the process group is nccl"),
    ("cuda", "gloo", "train.device=cuda computes on CUDA, but the process group is gloo"),
])
def test_device_must_match_the_process_group(monkeypatch, device, backend, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train_module.dist, "get_backend", lambda: backend)
    config = _config(f"train.device={device}")
    if message is None:
        assert compute_device(config).type == ("cuda" if backend == "nccl" else "cpu")
    else:
        with pytest.raises(ConfigError, match=message):
            compute_device(config)


class _Mallopt:
    """Stands in for glibc's mallopt: records the calls."""

    def __init__(self):
        self.calls, self.argtypes, self.restype = [], None, None

    def __call__(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def mallopt(monkeypatch):
    fake = _Mallopt()

    class Libc:
        pass

    libc = Libc()
    libc.mallopt = fake
    real = ctypes.CDLL  # other libraries (the C SwiGLU the backend probe builds) load as usual
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *args, **kwargs: libc if name is None else real(name, *args, **kwargs))
    return fake


def test_malloc_policy_for_cpu_ranks_only(mallopt):
    assert launch.keep_freed_memory(torch.device("cuda", 0)) is False
    assert launch.keep_freed_memory("cuda:1") is False
    assert mallopt.calls == []  # a GPU worker's heap is left to shrink
    assert launch.keep_freed_memory(torch.device("cpu")) is True
    assert mallopt.calls == [(-4, 0), (-1, 2 ** 31 - 1)]  # M_MMAP_MAX 0, M_TRIM_THRESHOLD never


@pytest.mark.parametrize("cuda, overrides, kept", [
    (False, [], True),
    (True, [], False),  # auto on a GPU host: a GPU worker
    (True, ["train.device=cpu"], True),
])
def test_train_command_sets_the_policy_by_the_rank_device(mallopt, monkeypatch, tmp_path, cuda, overrides, kept):
    """`moe-fold train` in one process asks for the policy with the device the run takes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    seen = []

    class Done:
        stop = None

    def fake_train(config, **kwargs):
        seen.append(compute_device(config).type)
        return Done()

    monkeypatch.setattr(train_module, "train", fake_train)
    # The kernel backends of a faked GPU cannot be probed; this test is about the malloc policy.
    monkeypatch.setattr(train_module, "resolve_backends", lambda config, device=None: config)
    argv = ["train", "--config", "mixtral-tiny", "--no-progress", "--set", "wandb.mode=disabled", "--set", "parallel.ep=1",
            "--set", f"train.run_dir={tmp_path}"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 0
    assert seen == ["cuda" if cuda and not overrides else "cpu"]
    assert bool(mallopt.calls) == kept


def test_train_command_refuses_cuda_without_a_gpu(capsys, tmp_path):
    argv = ["train", "--config", "mixtral-tiny", "--set", "train.device=cuda", "--set", "parallel.ep=1",
            "--set", f"train.run_dir={tmp_path}"]
    assert cli.main(argv) == 2
    assert "train.device=cuda needs CUDA, but torch.cuda.is_available() is False" in capsys.readouterr().err


def test_train_command_refuses_cuda_on_spawned_gloo_ranks(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["train", "--config", "mixtral-tiny", "--nproc", "2", "--set", "train.device=cuda",
            "--set", f"train.run_dir={tmp_path}"]
    assert cli.main(argv) == 2
    assert "train.device=cuda cannot run on the gloo ranks of --nproc=2" in capsys.readouterr().err
