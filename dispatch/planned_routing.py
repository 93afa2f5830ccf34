"""Routing fixed by a rule instead of read from the count exchange: what the dry run
(:mod:`moe_fold.training.dryrun`) gives the dispatchers, whose tensors carry no values.

A dispatcher reads its one count exchange through a count reader
(:attr:`moe_fold.dispatch.interface.TokenDispatcher.read_counts`): by default the
all-gathered counts themselves (:func:`read_gathered`). A :class:`PlannedRouting` answers
with the counts a rule gives instead, after the same collective ran, so every later size
(splits, rows per expert) follows the chosen routing on every rank alike.

Rules (``parse_routing``), for each source rank's ``T`` tokens and ``topk`` experts per token:

- ``balanced``: token ``i`` goes to slots ``(i*topk + j) mod E``: every slot within one row
  of the mean;
- ``one-expert``: every token to slots ``0 .. topk-1`` (one slot takes every token; the
  others no token at all);
- ``starve-rank:R``: balanced over every slot but those of ep rank ``R``, which receives nothing;
- ``zipf:S``: slot ``e`` drawn with weight ``1 / (e + 1)**S``, without repeats within a token,
  from a generator seeded by the source rank (the same on every traced rank).

With a capacity (``moe.capacity_factor``) each slot keeps its first ``capacity`` rows, as
the router drops the rest.

Zero-computation experts (``moe.zero_experts = Z``, :meth:`PlannedRouting.with_zero_experts`):
the router picks among the held slots and ``Z`` zero columns after them, and the
dispatcher counts only the held ones. The rules choose among all of them (balanced: a
token's ``topk`` columns cycle over held and zero ones alike; ``starve-rank`` keeps every
zero column; Zipf draws over all, the zero columns last), and the count a rule gives
drops the zero columns' rows: they are never sent. ``one-expert`` sends every slot to the
held slots ``0 .. topk-1``, the worst case whatever ``Z``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

__all__ = ["ROUTING_MODES", "PlannedRouting", "parse_routing", "read_gathered"]

ROUTING_MODES = ("balanced", "one-expert", "starve-rank:R", "zipf:S")

# What the columns of a count exchange hold, per dispatcher.
COLUMNS = ("slots", "slots+ranks", "tokens+slots")


def read_gathered(gathered: torch.Tensor, columns: str, num_tokens: int, topk: int, ep: int,
                  capacity: Optional[int]) -> list[list[int]]:
    """The default count reader: the all-gathered counts ``[etp*ep, C]`` on the host."""
    return gathered.tolist()


def parse_routing(text: str) -> "PlannedRouting":
    """``balanced``, ``one-expert``, ``starve-rank:R`` or ``zipf:S``; raises ValueError naming the rule."""
    name, _, arg = text.partition(":")
    if name in ("balanced", "one-expert") and not arg:
        return PlannedRouting(name)
    if name == "starve-rank" and arg.isdigit():
        return PlannedRouting(name, starved=int(arg))
    if name == "zipf":
        try:
            skew = float(arg)
        except ValueError:
            skew = -1.0
        if skew > 0:
            return PlannedRouting(name, skew=skew)
    raise ValueError(f"routing={text!r} must be one of {' | '.join(ROUTING_MODES)} "
                     f"(R an ep rank >= 0, S a positive skew)")


class PlannedRouting:
    """A count reader that answers with the counts of a routing rule (module docstring)."""

    def __init__(self, mode: str, *, starved: int = 0, skew: float = 1.0, zero_experts: int = 0):
        self.mode, self.starved, self.skew, self.zero_experts = mode, starved, skew, zero_experts
        self._cache: dict[tuple, list[list[int]]] = {}

    def with_zero_experts(self, zero_experts: int) -> "PlannedRouting":
        """The same rule over the held slots and ``zero_experts`` zero columns after them."""
        return PlannedRouting(self.mode, starved=self.starved, skew=self.skew, zero_experts=zero_experts)

    def describe(self) -> str:
        return {"starve-rank": f"starve-rank:{self.starved}", "zipf": f"zipf:{self.skew:g}"}.get(self.mode, self.mode)

    def assignment(self, num_tokens: int, num_slots: int, topk: int, ep: int, source: int) -> np.ndarray:
        """``[T, topk]`` columns of each token of source rank ``source`` (distinct within a
        token): held slots ``0 .. num_slots-1``, then the zero experts' columns."""
        tokens = np.arange(num_tokens)[:, None]
        columns = num_slots + self.zero_experts
        if self.mode == "one-expert":
            return np.broadcast_to(np.arange(topk), (num_tokens, topk)).copy()
        if self.mode == "zipf":
            rng = np.random.default_rng(source)
            weights = np.log(1.0 / np.arange(1, columns + 1) ** self.skew)
            keys = weights[None, :] + rng.gumbel(size=(num_tokens, columns))  # Gumbel top-k: draws without repeats
            return np.argsort(-keys, axis=1, kind="stable")[:, :topk]
        allowed = np.arange(columns)
        if self.mode == "starve-rank":
            if self.starved >= ep:
                raise ValueError(f"routing=starve-rank:{self.starved} names ep rank {self.starved}, but ep={ep}")
            per_rank = num_slots // ep
            allowed = np.array([s for s in range(columns) if s >= num_slots or s // per_rank != self.starved])
            if len(allowed) < topk:
                raise ValueError(f"routing=starve-rank:{self.starved} leaves {len(allowed)} slots, fewer than "
                                 f"topk={topk}")
        return allowed[(tokens * topk + np.arange(topk)[None, :]) % len(allowed)]

    def __call__(self, gathered: torch.Tensor, columns: str, num_tokens: int, topk: int, ep: int,
                 capacity: Optional[int]) -> list[list[int]]:
        sources, width = gathered.shape[0], gathered.shape[1]
        num_slots = {"slots": width, "slots+ranks": width - ep, "tokens+slots": width - 1}[columns]
        key = (columns, num_tokens, num_slots, sources, ep, capacity, topk)
        if key not in self._cache:
            self._cache[key] = [self._row(columns, num_tokens, num_slots, topk, ep, capacity, s)
                                for s in range(sources)]
        return self._cache[key]

    def _row(self, columns: str, num_tokens: int, num_slots: int, topk: int, ep: int,
             capacity: Optional[int], source: int) -> list[int]:
        slots = self.assignment(num_tokens, num_slots, topk, ep, source)  # [T, k]
        routed = np.zeros((num_tokens, num_slots + self.zero_experts), dtype=bool)
        routed[np.arange(num_tokens)[:, None], slots] = True
        routed = routed[:, :num_slots]  # a zero expert's rows stay where they are
        if capacity is not None:  # each slot keeps its first `capacity` tokens
            routed &= np.cumsum(routed, axis=0) <= capacity
        per_slot = routed.sum(axis=0).tolist()
        if columns == "slots":
            return per_slot
        if columns == "tokens+slots":
            return [num_tokens] + per_slot
        per_rank = routed.reshape(num_tokens, ep, num_slots // ep).any(axis=2).sum(axis=0).tolist()
        return per_slot + per_rank
