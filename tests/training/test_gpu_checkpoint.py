"""Checkpoints on a GPU: the CUDA random state round trip, and the asynchronous save's
pinned staging arena, whose device-to-host copies the writer waits for through a CUDA
event (no device-wide synchronisation). Run by the gpu child process
(tests/helpers/gpu_support.py); skipped with the reason where no GPU is visible."""

from __future__ import annotations

import pytest
import torch

from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint
from moe_fold.training.optim import build_optimizer, build_scheduler
from tests.training.test_checkpoint_async import _state, _touch_moments
from tests.training.test_optim import _config
from tests.training.test_wait_timer import _gpu_sleep_cycles

pytestmark = pytest.mark.gpu

ONE = ProcessGroups.single_process()


def _cuda_setup(config):
    model = build_model(config, ONE).cuda()
    opt = build_optimizer(model, config.optimizer, ONE)
    return model, opt, build_scheduler(opt, config)


def test_cuda_random_state_round_trip(tmp_path):
    """A checkpoint restores the CUDA generator: after loading, CUDA draws continue as
    they would have from the save (and the CPU's too)."""
    config = _config(moe=True)
    model, opt, sched = _cuda_setup(config)
    torch.cuda.manual_seed_all(5)
    torch.manual_seed(6)
    torch.randn(1000, device="cuda")  # move the generator off its seed
    path = save_checkpoint(tmp_path, 1, model, opt, sched, {"step": 1}, ONE, keep_last=1)
    want_cuda, want_cpu = torch.randn(64, device="cuda"), torch.randn(64)
    torch.cuda.manual_seed_all(99)
    torch.manual_seed(98)
    load_checkpoint(path, model, opt, sched, ONE)
    got_cuda, got_cpu = torch.randn(64, device="cuda"), torch.randn(64)
    assert torch.equal(got_cuda, want_cuda) and torch.equal(got_cpu, want_cpu)


def test_async_save_stages_through_a_pinned_arena_and_an_event(tmp_path, monkeypatch):
    """The save returns while its device-to-host copies are still queued behind ~200 ms
    of GPU work; training changes the tensors right after. The files hold the state at
    the save: the writer waited for the copies' event. No device-wide synchronisation,
    and the second save reuses the pinned arena."""
    config = _config(moe=True)
    model, opt, sched = _cuda_setup(config)
    saver = CheckpointSaver(tmp_path, ONE, keep_last=2, async_save=True, config=config)
    cycles = _gpu_sleep_cycles(torch.device("cuda"), 0.2)

    def no_device_sync(*args, **kwargs):
        raise AssertionError("the async save synchronised the whole device")

    states = {}
    for step in (1, 2):
        _touch_moments(model, opt)
        states[step] = {k: v.cpu() for k, v in _state(model, opt).items()}
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)  # the copies queue behind this
        monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
        saver.save(step, model, opt, sched, {"step": step})
        monkeypatch.undo()
        with torch.no_grad():  # "training" goes on, queued after the copies
            for p in model.parameters():
                p.add_(1.0)
                opt.state[p]["exp_avg"].mul_(-3.0)
        saver.wait()
        assert saver._arena.buffer.is_pinned() and saver._arena.allocations == 1
    for step in (1, 2):
        fresh, fresh_opt, fresh_sched = _cuda_setup(config)
        load_checkpoint(tmp_path / "checkpoints" / f"step_00000{step}", fresh, fresh_opt, fresh_sched, ONE)
        got = _state(fresh, fresh_opt)
        assert all(torch.equal(got[k].cpu(), states[step][k]) for k in states[step]), step
