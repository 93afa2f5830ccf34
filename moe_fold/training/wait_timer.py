"""How long the computation waited for a collective: the overlap metrics'
(``GradSync.exposed_s``, ``AdamW.gather_wait_s``) one clock.

With gloo the wait for a collective blocks the host, so the host clock measures it. With
NCCL ``work.wait()`` returns at once: it only makes the compute stream wait for the
communication stream, and the stall happens on the GPU, where the host clock reads about
0. There, a CUDA event is recorded on the compute stream before the wait and one after;
the time between them on the stream is the stall. Events are read back without a
synchronisation while the step runs (only those already passed), and the rest when the
total is asked for (:attr:`WaitTimer.seconds`, which then waits for them).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class WaitTimer:
    """Adds up waits: host clock for CPU tensors, CUDA events on the stream for CUDA ones."""

    def __init__(self):
        self._total_s = 0.0
        self._events: list[tuple] = []  # (start, end) torch.cuda.Event pairs not read yet

    @contextlib.contextmanager
    def waiting(self, device) -> Iterator[None]:
        """Time the ``with`` body, a wait for a collective whose result is on ``device``."""
        if getattr(device, "type", str(device).split(":")[0]) != "cuda":
            begin = time.perf_counter()
            yield
            self._total_s += time.perf_counter() - begin
            return
        import torch

        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._events.append((start, end))
        self._read(block=False)

    def _read(self, block: bool) -> None:
        """Fold the finished event pairs (all of them when ``block``) into the total."""
        while self._events:
            start, end = self._events[0]
            if not block and not end.query():
                return
            end.synchronize()
            self._total_s += start.elapsed_time(end) / 1000.0
            self._events.pop(0)

    @property
    def seconds(self) -> float:
        """The waits so far, in seconds (waits for the GPU events still in flight)."""
        self._read(block=True)
        return self._total_s
