"""The host copy an asynchronous checkpoint writes from: one staging arena, reused.

Training changes its tensors while a background thread writes a checkpoint, so the save
first copies this rank's pieces to host memory. :class:`StagingArena` holds that copy in
one flat byte buffer (pinned when a piece lives on a GPU, so the device-to-host copies run
asynchronously): sized to the state at the first save, reused by every later one, and
replaced by a larger one only when the state grows. One allocation for the run instead
of one per tensor, and no pinned memory held beyond the state's size.

On a GPU the copies are queued on each device's current stream and a CUDA event is
recorded after them; :meth:`Staged.wait` (called by the writer thread before it reads the
arena) waits for that event only. The training step goes on at once: its later kernels
are queued behind the copies on the same stream, so they cannot change a tensor before
it is copied, and no device-wide synchronisation stalls the other streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Each piece starts at a multiple of this many bytes: every dtype's alignment, and a
# cache line, so a view of the arena is a valid tensor of the piece's dtype.
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class Staged:
    """Host copies of one save's pieces, readable once :meth:`wait` returns."""

    pieces: list[tuple[str, torch.Tensor]]
    events: list = field(default_factory=list)  # torch.cuda.Event per device copied from

    def wait(self) -> None:
        """Block until every device-to-host copy has landed (nothing to wait for on CPU)."""
        for event in self.events:
            event.synchronize()


class StagingArena:
    """One host buffer for the pieces of every save (see the module docstring). One save
    at a time: the caller must let the writer of the previous :meth:`stage` finish before
    calling it again (CheckpointSaver.save waits for the previous save first)."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None  # uint8 [capacity]
        self.allocations = 0  # how many buffers were made: 1 while the state does not grow

    def _reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buffer = self.buffer
        if buffer is None or buffer.numel() < nbytes or (pinned and not buffer.is_pinned()):
            self.buffer = None  # the old one is freed before the new one is made
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self.buffer = buffer
            self.allocations += 1
        return buffer

    def stage(self, pieces: list[tuple[str, torch.Tensor]]) -> Staged:
        """Copy ``pieces`` (key, tensor on any device) into the arena; returns the host
        views, in the same order, and what to wait for before reading them."""
        sizes = [_aligned(t.numel() * t.element_size()) for _, t in pieces]
        cuda = any(t.is_cuda for _, t in pieces)
        buffer = self._reserve(max(sum(sizes), 1), pinned=cuda)
        copies, offset, devices = [], 0, []
        for (key, t), size in zip(pieces, sizes):
            nbytes = t.numel() * t.element_size()
            view = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda and t.device not in devices:
                devices.append(t.device)
            copies.append((key, view))
            offset += size
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return Staged(copies, events)
