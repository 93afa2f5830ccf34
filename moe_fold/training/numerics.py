"""Non-finite values and loss spikes in training: finding where they start, flagging them.

- :func:`first_nonfinite_module`: after a step whose loss or grad norm is not finite, the
  training loop runs the step's forwards again (no grad, so nothing is counted twice)
  with a hook on every module and reports the first module, in execution order, whose
  output holds a NaN or an inf. Hooks fire when a module returns, so an inner module
  that made the first non-finite value is named before the block that holds it.
- :class:`LossSpikes`: a loss above ``factor`` times the median of the previous
  ``window`` losses is a spike (a median, so one spike does not hide the next).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch import nn

from moe_fold.config import require, spike_detection

__all__ = ["first_nonfinite_module", "LossSpikes"]


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _nonfinite(value: Any) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(value))


def first_nonfinite_module(model: nn.Module, run_forward: Callable[[], Any]) -> Optional[tuple[str, int]]:
    """``(name, position)`` of the first module whose forward output is non-finite while
    ``run_forward()`` runs: its name in ``model.named_modules()`` (the class name for
    ``model`` itself) and how many module outputs came before it (to compare ranks that
    run the same modules); None when every output stays finite."""
    found: list[tuple[str, int]] = []
    returned = [0]

    def hook(name: str):
        def check(module, args, output):
            if not found and _nonfinite(output):
                found.append((name or type(model).__name__, returned[0]))
            returned[0] += 1
        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


class LossSpikes:
    """Flags a loss above ``factor`` x the median of the previous ``window`` finite losses
    (judged once ``window`` losses are there); ``factor`` 0 turns it off."""

    def __init__(self, factor: float, window: int):
        require(spike_detection, factor, window)
        self.factor = factor
        self.history: deque[float] = deque(maxlen=window)

    def median(self) -> Optional[float]:
        """The median of the window, None until it is full."""
        if len(self.history) < self.history.maxlen:
            return None
        return statistics.median(self.history)

    def check(self, loss: float) -> bool:
        """Whether ``loss`` is a spike; a finite loss then joins the window."""
        median = self.median()
        spike = self.factor > 0 and median is not None and loss > self.factor * median
        if math.isfinite(loss):
            self.history.append(loss)
        return spike
