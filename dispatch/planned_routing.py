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

from typing import Iterator, Optional

import numpy as np
import torch

__all__ = ["ROUTING_MODES", "PlannedRouting", "parse_routing", "read_gathered"]

ROUTING_MODES = ("balanced", "one-expert", "starve-rank:R", "zipf:S")

# What the columns of a count exchange hold, per dispatcher.
COLUMNS = ("slots", "slots+ranks", "tokens+slots")

# Tokens whose routing is drawn at once: the work arrays are this many rows by the slots.
CHUNK_TOKENS = 1024


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
        parts = list(self._chunks(num_tokens, num_slots, topk, ep, source))
        return np.concatenate(parts) if parts else np.zeros((0, topk), dtype=np.int64)

    def _chunks(self, num_tokens: int, num_slots: int, topk: int, ep: int, source: int) -> Iterator[np.ndarray]:
        """:meth:`assignment` in consecutive ``[<= CHUNK_TOKENS, topk]`` pieces: a rank's
        tokens times the slots (128K x 256 at full size) never exist at once. Zipf draws
        each piece's rows after the previous piece's from one generator, so the pieces
        are the rows of one draw."""
        columns = num_slots + self.zero_experts
        allowed = np.arange(columns)
        if self.mode == "starve-rank":
            if self.starved >= ep:
                raise ValueError(f"routing=starve-rank:{self.starved} names ep rank {self.starved}, but ep={ep}")
            per_rank = num_slots // ep
            allowed = allowed[(allowed >= num_slots) | (allowed // per_rank != self.starved)]
            if len(allowed) < topk:
                raise ValueError(f"routing=starve-rank:{self.starved} leaves {len(allowed)} slots, fewer than "
                                 f"topk={topk}")
        rng = np.random.default_rng(source) if self.mode == "zipf" else None
        weights = np.log(1.0 / np.arange(1, columns + 1) ** self.skew)
        for first in range(0, num_tokens, CHUNK_TOKENS):
            count = min(CHUNK_TOKENS, num_tokens - first)
            if self.mode == "one-expert":
                yield np.broadcast_to(np.arange(topk), (count, topk)).copy()
            elif self.mode == "zipf":
                keys = weights[None, :] + rng.gumbel(size=(count, columns))  # Gumbel top-k: draws without repeats
                yield np.argsort(-keys, axis=1, kind="stable")[:, :topk]
            else:
                tokens = np.arange(first, first + count)[:, None]
                yield allowed[(tokens * topk + np.arange(topk)[None, :]) % len(allowed)]

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
        per_slot = np.zeros(num_slots, dtype=np.int64)  # rows each slot keeps
        per_rank = np.zeros(ep, dtype=np.int64)  # tokens with a kept row on each ep rank
        for slots in self._chunks(num_tokens, num_slots, topk, ep, source):  # [c, k]
            routed = np.zeros((len(slots), num_slots + self.zero_experts), dtype=bool)
            routed[np.arange(len(slots))[:, None], slots] = True
            routed = routed[:, :num_slots]  # a zero expert's rows stay where they are
            if capacity is not None:  # each slot keeps its first `capacity` tokens
                routed &= per_slot[None, :] + np.cumsum(routed, axis=0) <= capacity
            per_slot += routed.sum(axis=0)
            if columns == "slots+ranks":
                per_rank += routed.reshape(len(slots), ep, num_slots // ep).any(axis=2).sum(axis=0)
        if columns == "slots":
            return per_slot.tolist()
        if columns == "tokens+slots":
            return [num_tokens] + per_slot.tolist()
        return per_slot.tolist() + per_rank.tolist()
