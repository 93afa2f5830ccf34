"""The overlap metrics' clock (moe_fold/training/wait_timer.py): the host clock where the
wait blocks the host (gloo, CPU), CUDA events where it stalls the stream (NCCL)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.training.buckets import GradSync, make_buckets
from moe_fold.training.optim import AdamW
from moe_fold.training.wait_timer import WaitTimer

LATE_S = 0.3  # how long rank 1 comes late to each collective


def _late_rank(rank, world_size):
    """Rank 1 joins the gradient all-reduce and the parameter all-gather LATE_S late: rank
    0's exposed_s and gather_wait_s are its waits for rank 1; the results are right."""
    groups = create_process_groups(ParallelLayout(world_size))
    p = nn.Parameter(torch.full((64,), 1.0))
    p.parallel = "replicated"
    p.grad = torch.full((64,), float(rank + 1))
    sync = GradSync(make_buckets([[p]], groups), groups)
    opt = AdamW([p], lr=0.1, groups=groups, distributed=True)
    if rank == 1:
        time.sleep(LATE_S)
    sync.finish()
    grad = p.grad.clone()
    if rank == 1:
        time.sleep(LATE_S)
    opt.step()
    return sync.exposed_s, opt.gather_wait_s, grad, p.detach().clone()


def test_host_clock_counts_the_waits_of_gloo_collectives():
    (exposed0, gather0, grad0, p0), (exposed1, gather1, grad1, p1) = run_ranks(_late_rank, 2, timeout=120)
    assert LATE_S * 0.8 < exposed0 < LATE_S * 5 and LATE_S * 0.8 < gather0 < LATE_S * 5
    # Rank 1 arrived last: its waits are the collectives' own time, far below rank 0's.
    assert exposed1 < exposed0 / 2 and gather1 < gather0 / 2
    assert torch.equal(grad0, torch.full((64,), 1.5)) and torch.equal(grad0, grad1)
    assert torch.equal(p0, p1) and not torch.equal(p0, torch.ones(64))


def test_cpu_waits_use_the_host_clock():
    timer = WaitTimer()
    with timer.waiting(torch.device("cpu")):
        time.sleep(0.05)
    with timer.waiting("cpu"):
        pass
    assert 0.05 <= timer.seconds < 1.0
    assert timer._events == []


def _gpu_sleep_cycles(device, seconds: float) -> int:
    """Cycles of torch.cuda._sleep that last about ``seconds`` on ``device`` (measured)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * seconds * 1000.0 / start.elapsed_time(end))


@pytest.mark.gpu
def test_cuda_waits_are_timed_on_the_stream_not_the_host():
    """The compute stream waits for a side stream that sleeps ~100 ms on the GPU (as it
    waits for NCCL's stream): the host goes on at once, the events see the stall."""
    device = torch.device("cuda", torch.cuda.current_device())
    cycles = _gpu_sleep_cycles(device, 0.1)
    side = torch.cuda.Stream(device)
    timer = WaitTimer()
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
    with timer.waiting(device):
        torch.cuda.current_stream(device).wait_stream(side)
    host_s = time.perf_counter() - begin
    assert host_s < 0.05, host_s  # nothing blocked the host
    assert 0.07 < timer.seconds < 1.0
    assert timer._events == []  # read back, once asked for
