"""Expert placement: which global expert each ep rank's expert slots hold.

An MoE layer has ``E`` global experts and every ep rank ``S`` expert *slots* (the local
experts of the grouped GEMM). A :class:`Placement` lists the global expert of each of the
``ep * S`` slots, rank-major (slot ``j * S + i`` is slot ``i`` of ep rank ``j``). With
``S = E / ep`` and ``slots = 0, 1, ..., E-1`` it is today's contiguous split, the default,
which every code path keeps bit for bit (no extra work is done for it). Any permutation
is allowed, and with ``replicas`` spare slots per rank (``S = E / ep + replicas``) an
expert may have copies on several ranks (at most one per rank). Global expert ids stay
the identity of a tensor: checkpoints, Hugging Face export and the router never see slots.

What a copy means for the math (:func:`slot_routing`): the ``n`` tokens a source rank
routes to an expert with ``c`` copies are cut, in token order, into ``c`` contiguous
runs of nearly equal size, run ``k`` going to copy ``k``. Every (token, expert) pair is
computed exactly once, so the output is unchanged; capacity stays per expert (the router
drops before the split). Each copy's gradient covers its own tokens; the copies' grads
are summed (:func:`moe_fold.training.replace.sum_replica_grads`) so the copies take the same
step and stay identical.

:func:`balanced_placement` is the policy used to re-place experts from measured load:
give the hottest experts the spare slots (one more copy at a time to the expert with the
largest load per copy), then longest-processing-time-first over the ranks, then swaps
between the busiest rank and the others while they lower it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from moe_fold.config import experts_over_ep, replicas_fit, require

__all__ = ["Placement", "slot_routing", "expert_order", "rank_loads", "balanced_placement"]


@dataclass(frozen=True)
class Placement:
    """``slots[j * S + i]``: the global expert of slot ``i`` on ep rank ``j``; see the module doc.

    Every expert must have a slot, and a rank holds at most one copy of an expert.
    """

    num_experts: int
    ep: int
    slots: tuple[int, ...]
    _copies: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    # slot_routing's index tensors per device (see _slot_indices).
    _on_device: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", tuple(int(s) for s in self.slots))
        e, ep, n = self.num_experts, self.ep, len(self.slots)
        if e < 1 or ep < 1:
            raise ValueError(f"placement needs num_experts >= 1 and ep >= 1, got {e} and {ep}")
        if n % ep or n < e:
            raise ValueError(f"placement has {n} slots: it needs a multiple of ep={ep} and at least "
                             f"num_experts={e}")
        bad = [s for s in self.slots if not 0 <= s < e]
        if bad:
            raise ValueError(f"placement slots hold experts {bad[:4]} outside [0, num_experts={e})")
        copies: list[list[int]] = [[] for _ in range(e)]
        for slot, expert in enumerate(self.slots):
            copies[expert].append(slot)
        missing = [x for x in range(e) if not copies[x]]
        if missing:
            raise ValueError(f"placement leaves experts {missing[:8]} without a slot")
        s = n // ep
        for j in range(ep):
            mine = self.slots[j * s:(j + 1) * s]
            if len(set(mine)) != s:
                raise ValueError(f"placement puts two copies of one expert on ep rank {j}: {list(mine)}")
        object.__setattr__(self, "_copies", tuple(tuple(c) for c in copies))
        object.__setattr__(self, "_on_device", {})

    @classmethod
    def contiguous(cls, num_experts: int, ep: int, replicas: int = 0) -> "Placement":
        """Rank ``j`` holds experts ``[j*E/ep, (j+1)*E/ep)``; its ``replicas`` spare slots
        hold copies of the experts that follow (those of the next ranks, wrapping round)."""
        require(experts_over_ep, num_experts, ep)
        require(replicas_fit, num_experts, ep, replicas)
        el = num_experts // ep
        slots = []
        for j in range(ep):
            slots += list(range(j * el, (j + 1) * el))
            slots += [((j + 1) * el + k) % num_experts for k in range(replicas)]
        return cls(num_experts, ep, tuple(slots))

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.ep

    @property
    def is_default(self) -> bool:
        """The contiguous split without spare slots: dispatchers skip the slot mapping."""
        return self.slots == tuple(range(self.num_experts))

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The global experts of ep rank ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return self.slots[rank * s:(rank + 1) * s]

    def copies(self, expert: int) -> tuple[int, ...]:
        """The slots holding ``expert``, ascending; the first is its primary copy."""
        return self._copies[expert]

    def copy_index(self, slot: int) -> int:
        """Which copy of its expert ``slot`` holds (0 for the primary)."""
        return self._copies[self.slots[slot]].index(slot)

    def primary(self, slot: int) -> bool:
        return self.copy_index(slot) == 0

    def num_copies(self) -> list[int]:
        return [len(c) for c in self._copies]

    def to_list(self) -> list[int]:
        return list(self.slots)


def slot_routing(placement: Placement, routing_map: torch.Tensor, probs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing over slots: ``routing_map[T, E]``, ``probs[T, E]`` ->
    ``[T, ep*S]`` each, every routed (token, expert) pair on exactly one copy of the expert
    (see the module doc). Differentiable w.r.t. probs."""
    cols, c, copy = _slot_indices(placement, routing_map.device)
    slot_map = routing_map.index_select(1, cols)  # [T, E] -> [T, ep*S]
    if c is not None:
        pos = torch.cumsum(routing_map, dim=0) - 1  # [T, E]: the token's rank within its expert
        n = routing_map.sum(dim=0).clamp(min=1)  # [E]
        which = pos * c // n  # [T, E]: the copy each pair goes to
        slot_map = slot_map & (which.index_select(1, cols) == copy)
    return slot_map, probs.index_select(1, cols)


def _slot_indices(placement: Placement, device: torch.device
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``[ep*S]`` expert of each slot; with copies also ``[E]`` copies of each expert and
    ``[ep*S]`` copy index of each slot (else None). Made once per device: lists copied to a
    GPU at every forward would each block the host."""
    if device not in placement._on_device:
        cols = torch.tensor(placement.slots, device=device)
        copies = placement.num_copies()
        c = copy = None
        if max(copies) > 1:
            c = torch.tensor(copies, device=device)
            copy = torch.tensor([placement.copy_index(s) for s in range(len(placement.slots))], device=device)
        placement._on_device[device] = (cols, c, copy)
    return placement._on_device[device]


def expert_order(placement: Placement) -> list[int]:
    """The slots sorted by (expert, copy): the ``sort_chunks`` order that turns slot-major
    rows back into the expert-major order of the default placement, so a token's rows
    are summed in the same order whatever the placement."""
    return [slot for expert in range(placement.num_experts) for slot in placement.copies(expert)]


def rank_loads(placement: Placement, load: Sequence[float]) -> list[float]:
    """The tokens each ep rank computes when expert ``e`` receives ``load[e]`` tokens
    (split evenly between its copies)."""
    copies = placement.num_copies()
    return [sum(load[e] / copies[e] for e in placement.rank_slots(j)) for j in range(placement.ep)]


def balanced_placement(load: Sequence[float], ep: int, replicas: int = 0,
                       previous: Optional[Placement] = None) -> Placement:
    """A placement of ``len(load)`` experts on ``ep`` ranks with ``E/ep + replicas`` slots
    each that keeps the busiest rank's load low (see the module doc). Deterministic.

    ``previous``: the ranks are renumbered (the result is symmetric in them) so that as
    many experts as possible stay where they were, and a rank keeps its experts in the
    slots they had: fewer bytes move.
    """
    e = len(load)
    require(experts_over_ep, e, ep)
    require(replicas_fit, e, ep, replicas)
    s = e // ep + replicas
    load = [float(x) for x in load]
    copies = [1] * e
    # Spare slots: one more copy to the expert with the largest load per copy.
    heap = [(-load[x], x) for x in range(e)]
    heapq.heapify(heap)
    for _ in range(replicas * ep):
        while True:
            _, x = heapq.heappop(heap)
            if copies[x] < ep:
                break
        copies[x] += 1
        if copies[x] < ep:
            heapq.heappush(heap, (-load[x] / copies[x], x))
    # Longest processing time first, copies of one expert on distinct ranks.
    items = sorted(((load[x] / copies[x], x) for x in range(e) for _ in range(copies[x])),
                   key=lambda it: (-it[0], it[1]))
    bins: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    for weight, x in items:
        open_ = [j for j in range(ep) if len(bins[j]) < s and x not in bins[j]]
        if open_:
            j = min(open_, key=lambda r: (totals[r], r))
        else:
            j = _make_room(bins, x, s, load, copies, totals)
        bins[j].append(x)
        totals[j] += weight
    _improve(bins, totals, [load[x] / copies[x] for x in range(e)])
    order = _rank_order(bins, previous) if previous is not None else list(range(ep))
    slots = []
    for j in range(ep):
        mine = bins[order[j]]
        old = previous.rank_slots(j) if previous is not None else ()
        kept = [x if x in mine else None for x in old] if len(old) == s else [None] * s
        rest = iter(sorted(x for x in mine if x not in kept))
        slots += [x if x is not None else next(rest) for x in kept]
    return Placement(e, ep, tuple(slots))


def _improve(bins: list[list[int]], totals: list[float], weight: list[float], rounds: int = 200) -> None:
    """Local search after LPT (which the equal slot counts hamper): swap an expert of the
    busiest rank with a lighter one of another rank while that lowers the pair's maximum."""
    for _ in range(rounds):
        b = max(range(len(bins)), key=lambda r: (totals[r], -r))
        best = None  # (new pair maximum, rank, index in bins[b], index in bins[r])
        for r in range(len(bins)):
            if r == b:
                continue
            for i, x in enumerate(bins[b]):
                for k, y in enumerate(bins[r]):
                    delta = weight[x] - weight[y]
                    if delta <= 0 or x in bins[r] or y in bins[b]:
                        continue
                    peak = max(totals[b] - delta, totals[r] + delta)
                    if peak < totals[b] - 1e-12 * totals[b] and (best is None or peak < best[0]):
                        best = (peak, r, i, k)
        if best is None:
            return
        _, r, i, k = best
        x, y = bins[b][i], bins[r][k]
        bins[b][i], bins[r][k] = y, x
        delta = weight[x] - weight[y]
        totals[b] -= delta
        totals[r] += delta


def _make_room(bins: list[list[int]], x: int, s: int, load, copies, totals) -> int:
    """Every rank with a free slot already holds ``x``: move an expert from a full rank
    without ``x`` to one of them, and return the full rank (now with a free slot)."""
    for free in (j for j in range(len(bins)) if len(bins[j]) < s):
        for full in (j for j in range(len(bins)) if x not in bins[j]):
            for y in bins[full]:
                if y not in bins[free]:
                    bins[full].remove(y)
                    bins[free].append(y)
                    totals[full] -= load[y] / copies[y]
                    totals[free] += load[y] / copies[y]
                    return full
    raise AssertionError(f"no room for a copy of expert {x}")  # unreachable: copies[x] <= ep


def _rank_order(bins: list[list[int]], previous: Placement) -> list[int]:
    """``order[j]``: the bin that goes to rank ``j``, greedily keeping the most experts in place."""
    ep = len(bins)
    pairs = sorted(((-len(set(bins[b]) & set(previous.rank_slots(j))), j, b) for j in range(ep) for b in range(ep)))
    order: dict[int, int] = {}
    used: set[int] = set()
    for _, j, b in pairs:
        if j not in order and b not in used:
            order[j] = b
            used.add(b)
    return [order[j] for j in range(ep)]
