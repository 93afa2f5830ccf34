"""Deterministic fault injection for tests and benches: a :class:`FaultPlan`.

A bad step is hard to provoke on purpose with real data, so a run can be handed a plan
(``train(config, faults=FaultPlan.parse(...))``, or ``moe-fold train --faults PLAN``,
which every rank parses, whether started by ``--nproc`` or torchrun): comma-separated
items ``KIND@WHERE=N``.

- ``KIND``: ``nan`` or ``inf`` (the step's global loss becomes non-finite: no optimizer
  step, as for any non-finite loss; ``train.on_nonfinite`` decides the rest) or
  ``spike`` (the step's global LM loss is multiplied by :data:`SPIKE_FACTOR`; the
  gradients and the update are the real ones, so ``train.on_loss_spike`` decides whether
  the step stands);
- ``WHERE``: ``step=N`` (the N-th optimizer step, again each time the run reaches it:
  a fault a rollback cannot get past) or ``batch=N`` (global batch N, 0-based: a bad
  batch, gone once it is skipped).

Example: ``--faults nan@batch=5,spike@step=9``. The fault is applied on every rank
to the loss after its reduction, so every rank sees the same value, as with a real one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["SPIKE_FACTOR", "Fault", "FaultPlan"]

SPIKE_FACTOR = 100.0
_ITEM = re.compile(r"(nan|inf|spike)@(step|batch)=(\d+)")


@dataclass(frozen=True)
class Fault:
    kind: str  # nan | inf | spike
    where: str  # step | batch
    at: int


class FaultPlan:
    """Faults to inject into a run (``FaultPlan()``: none)."""

    def __init__(self, faults: tuple[Fault, ...] = ()):
        self.faults = faults

    @classmethod
    def parse(cls, text: str, name: str = "--faults") -> "FaultPlan":
        """The plan written as ``text`` (empty: none); ValueError naming ``name`` (where
        the text came from), the item and the rule."""
        text = text.strip()
        faults = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            match = _ITEM.fullmatch(item)
            if match is None:
                raise ValueError(f"{name}={text!r}: item {item!r} is not KIND@WHERE=N with KIND nan, inf or spike, "
                                 f"WHERE step or batch, N an integer >= 0 (e.g. nan@batch=5)")
            faults.append(Fault(match[1], match[2], int(match[3])))
        return cls(tuple(faults))

    def apply(self, loss: torch.Tensor, step: int, batch: int) -> torch.Tensor:
        """``loss`` (the step's reduced loss) as the plan makes it at ``step``, global ``batch``."""
        for fault in self.faults:
            if fault.at != (step if fault.where == "step" else batch):
                continue
            if fault.kind == "spike":
                loss = loss * SPIKE_FACTOR
            else:
                loss = torch.full_like(loss, float(fault.kind))
        return loss
