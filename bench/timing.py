"""Timing shared by the bench scripts that import it (run those as ``python -m bench.<name>``,
as the suite does): interleaved rounds on one device, and a step timed between barriers
on every rank."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA device; nothing is queued on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians_ms(candidates: dict[Hashable, Callable[[], object]], repeats: int,
                           device: torch.device) -> dict[Hashable, float]:
    """Median milliseconds of each candidate over ``repeats`` rounds, each round running
    every candidate once in turn: a load that drifts over the run falls on all alike."""
    times: dict[Hashable, list[float]] = {key: [] for key in candidates}
    for _ in range(repeats):
        for key, fn in candidates.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def barrier_timed_ms(step: Callable[[], object]) -> float:
    """Milliseconds of ``step()`` between two barriers of the default group: every rank
    reads the slowest rank's time."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return (time.perf_counter() - start) * 1e3
