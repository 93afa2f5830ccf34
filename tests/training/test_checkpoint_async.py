"""Asynchronous checkpoints (issue 17): the step pays for a host copy only, the copy is
what gets written, the write stays atomic and keeps the last K, an error in the
background reaches the caller, and a process SIGKILLed mid-write leaves the previous
checkpoint loadable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from moe_fold.layout import ProcessGroups
from moe_fold.training import checkpoint as ckpt
from moe_fold.training.checkpoint import (CheckpointError, CheckpointSaver, latest_checkpoint, load_checkpoint,
                                          save_checkpoint)
from moe_fold.training.checkpoint_verify import verify_checkpoint
from tests.helpers.paths import REPO
from tests.training.test_checkpoint import _setup
from tests.training.test_optim import _config

ONE = ProcessGroups.single_process()


def _state(model, opt):
    return {**{f"p/{n}": p.detach().clone() for n, p in model.named_parameters()},
            **{f"m/{n}": opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}}


def _touch_moments(model, opt):
    for p in model.parameters():
        opt.state[p]["exp_avg"].copy_(torch.randn_like(p))


def test_async_save_writes_the_host_copy_while_training_changes_the_tensors(tmp_path):
    config = _config(moe=True)
    model, opt, sched = _setup(config, ONE)
    _touch_moments(model, opt)
    saved = _state(model, opt)
    saver = CheckpointSaver(tmp_path, ONE, keep_last=2, async_save=True, config=config)
    path = saver.save(1, model, opt, sched, {"step": 1})
    with torch.no_grad():  # "training" goes on while the background thread writes
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["exp_avg"].mul_(-3.0)
    assert saver.wait() == path
    assert latest_checkpoint(tmp_path) == path
    fresh, fresh_opt, fresh_sched = _setup(config, ONE)
    assert load_checkpoint(path, fresh, fresh_opt, fresh_sched, ONE) == {"step": 1}
    got = _state(fresh, fresh_opt)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    # The same files as a synchronous save of the same state.
    sync = save_checkpoint(tmp_path / "sync", 1, fresh, fresh_opt, fresh_sched, {"step": 1}, ONE, keep_last=1)
    a, b = json.loads((path / "index.json").read_text()), json.loads((sync / "index.json").read_text())
    assert a["tensors"] == b["tensors"]
    assert a["files"]["rank_00000.safetensors"] == b["files"]["rank_00000.safetensors"]
    assert sorted(os.listdir(path)) == sorted(os.listdir(sync))  # no done markers left


def test_async_saves_keep_the_last_k_and_reuse_their_buffer(tmp_path):
    """Three saves, each of a changed state, through one staging arena allocated once:
    each checkpoint holds its own step's values."""
    config = _config(moe=True)
    model, opt, sched = _setup(config, ONE)
    saver = CheckpointSaver(tmp_path, ONE, keep_last=2, async_save=True, config=config)
    states, arenas = {}, []
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(step))
        states[step] = _state(model, opt)
        saver.save(step, model, opt, sched, {"step": step})  # waits for the previous one first
        arenas.append(saver._arena.buffer.data_ptr())
    assert saver.wait().name == "step_000003"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002", "step_000003"]
    assert saver._arena.allocations == 1 and len(set(arenas)) == 1
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_000003").ok
    for step in (2, 3):
        fresh, fresh_opt, fresh_sched = _setup(config, ONE)
        load_checkpoint(tmp_path / "checkpoints" / f"step_00000{step}", fresh, fresh_opt, fresh_sched, ONE)
        got = _state(fresh, fresh_opt)
        assert all(torch.equal(got[k], states[step][k]) for k in states[step]), step


def test_a_failed_background_write_reaches_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    config = _config(moe=True)
    model, opt, sched = _setup(config, ONE)
    saver = CheckpointSaver(tmp_path, ONE, keep_last=3, async_save=True, config=config)
    good = saver.save(1, model, opt, sched, {"step": 1})
    saver.wait()

    def disk_full(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_safetensors", disk_full)
    saver.save(2, model, opt, sched, {"step": 2})
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*step_000002 failed: .*No space left on device"):
        saver.wait()
    assert saver.wait() is None  # reported once
    assert latest_checkpoint(tmp_path) == good


# A child process saves step 1, then starts an asynchronous save of step 2 whose file
# writes crawl (each write() of the real writer sleeps); the test SIGKILLs it mid-write.
_CHILD = textwrap.dedent("""
    import builtins, sys, time
    from pathlib import Path
    import torch
    from moe_fold.layout import ProcessGroups
    from moe_fold.training import checkpoint as ckpt
    from tests.training.test_checkpoint import _setup
    from tests.training.test_optim import _config

    run_dir, marker = Path(sys.argv[1]), Path(sys.argv[2])
    ONE = ProcessGroups.single_process()
    config = _config(moe=True)
    model, opt, sched = _setup(config, ONE)
    saver = ckpt.CheckpointSaver(run_dir, ONE, keep_last=2, async_save=True, config=config)
    saver.save(1, model, opt, sched, {"step": 1})
    saver.wait()

    class Crawling:
        def __init__(self, f):
            self.f = f
        def write(self, data):
            n = self.f.write(data)
            self.f.flush()
            marker.touch()
            time.sleep(0.5)
            return n
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    ckpt.open = lambda *a, **k: Crawling(builtins.open(*a, **k))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saver.save(2, model, opt, sched, {"step": 2})
    while True:  # training would go on here
        time.sleep(0.1)
""")


def test_sigkill_during_a_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    marker = tmp_path / "writing"
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, str(script), str(run_dir), str(marker)],
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the child exited before writing"
            assert time.monotonic() < deadline, "the child never started the background write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    folder = run_dir / "checkpoints"
    partial = [p for p in os.listdir(folder) if p.startswith("step_000002.tmp-")]
    assert len(partial) == 1 and not (folder / partial[0] / "index.json").exists()
    shard = folder / partial[0] / "rank_00000.safetensors"
    assert 0 < shard.stat().st_size  # killed with the shard half written
    assert latest_checkpoint(run_dir) == folder / "step_000001"
    assert verify_checkpoint(folder / "step_000001").ok
    config = _config(moe=True)
    model, opt, sched = _setup(config, ONE)  # the same seed: step 1 holds these values
    expected = _state(model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_checkpoint(run_dir, model, opt, sched, ONE) == {"step": 1}
    got = _state(model, opt)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def _two_rank_groups():
    from moe_fold.layout import GROUP_NAMES, ParallelLayout

    return ProcessGroups(ParallelLayout(2), 0, {name: None for name in GROUP_NAMES})


def test_rank_0_names_a_rank_that_failed_or_went_silent(tmp_path):
    """Rank 0 finishes a checkpoint from the ranks' done markers: a rank's error is
    named at once; a rank whose shard stops growing for timeout_s is given up on."""
    saver = CheckpointSaver(tmp_path, _two_rank_groups(), keep_last=1, timeout_s=1.0)
    folder = tmp_path / "step_000001.tmp-0000"
    folder.mkdir()
    (folder / "done_00000.json").write_text(json.dumps({"files": {}}))
    (folder / "done_00001.json").write_text(json.dumps({"error": "OSError: [Errno 28] No space left on device"}))
    with pytest.raises(CheckpointError, match=r"rank 1 could not write its part of .*step_000001.tmp-0000: "
                                              r"OSError: \[Errno 28\] No space left on device"):
        saver._wait_for_ranks(folder)
    (folder / "done_00001.json").unlink()
    (folder / "rank_00001.safetensors").write_bytes(b"half")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"ranks \[1\] wrote nothing into .* for 1 s \(parallel.timeout_s\): "
                                              r"the checkpoint is left unfinished, the previous ones are kept"):
        saver._wait_for_ranks(folder)
    assert 1.0 <= time.monotonic() - start < 10


def test_an_error_in_the_loop_still_waits_for_the_background_write(tmp_path, monkeypatch):
    """A step that raises after a save: the run ends only once the checkpoint of the
    save before it is complete (renamed, every file matching the manifest)."""
    from moe_fold.training.metrics import MetricsLogger
    from moe_fold.training.train import train
    from tests.training.test_train import small_config

    write = ckpt._write_safetensors

    def slow_write(path, tensors):
        time.sleep(1.0)
        return write(path, tensors)

    log = MetricsLogger.log

    def failing_log(self, record, collector):
        if record["step"] == 3:
            raise RuntimeError("step 3 failed")
        return log(self, record, collector)

    monkeypatch.setattr(ckpt, "_write_safetensors", slow_write)
    monkeypatch.setattr(MetricsLogger, "log", failing_log)
    config = small_config(tmp_path / "run", tmp_path / "cache", "train.steps=4", "train.save_every=2")
    with pytest.raises(RuntimeError, match="step 3 failed"):
        train(config)
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(folder)) == ["step_000002"]
    assert verify_checkpoint(folder / "step_000002").ok
