"""Context parallelism for recurrent mixers (Gated DeltaNet): the sequence order that a
recurrence needs, kept under the zigzag split.

The zigzag split cuts every sequence in ``2*cp`` segments and gives cp rank r segments
r and ``2cp-1-r`` (:func:`moe_fold.parallel.context_parallel.zigzag_split`). A recurrent
layer does not move tokens back to contiguous order: each rank runs its two segments
where they are, and only what crosses a segment edge travels, in sequence order:

- the causal conv's window: the last ``K-1`` inputs of every segment are all-gathered,
  and segment i reads those of segment i-1 (zeros before segment 0);
- the recurrent state, by a prefix scan: a segment maps its start state to its end state
  by an affine map ``S_end = A S_start + B`` (A ``[dk, dk]``: the decays and the
  ``I - b k k^T`` factors; B ``[dk, dv]``: what the segment writes from a zero state).
  Every rank all-gathers every segment's (A, B) and composes them in order, which gives
  each of its segments its start state; it then runs the segment from that state.

The gathers' backward is a reduce-scatter, so the gradients reaching A and B are the sums
over the ranks that used them: the result and its gradients are the one-process ones
(``tests/parallel/test_recurrent_cp.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_fold.comm import Group, all_gather, group_rank, group_size


def local_segments(s_local: int, group: Group) -> list[tuple[int, int, int]]:
    """This rank's segments as ``(local start, local end, sequence index)``, in local
    order: one segment (index 0) without cp; segments r and ``2cp-1-r`` under cp."""
    cp = group_size(group)
    if cp == 1:
        return [(0, s_local, 0)]
    half, r = s_local // 2, group_rank(group)
    return [(0, half, r), (half, s_local, 2 * cp - 1 - r)]


def _in_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """``[cp*2, ...]`` (rank-major: rank r's segments r, 2cp-1-r) -> ``[2cp, ...]`` by
    segment index."""
    order = [0] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = 2 * r, 2 * r + 1
    return gathered[order]


def conv_histories(tails: torch.Tensor, group: Group) -> list[Optional[torch.Tensor]]:
    """``tails [n_local, K-1, B, C]``: the last K-1 conv inputs of each local segment ->
    each local segment's history (the tail of the segment before it; None for segment 0,
    whose history is zeros)."""
    cp = group_size(group)
    if cp == 1:
        return [None]
    ordered = _in_sequence_order(all_gather(tails, group, dim=0), cp)  # [2cp, K-1, B, C]
    return [None if i == 0 else ordered[i - 1] for _, _, i in local_segments(2, group)]


def start_states(transitions: torch.Tensor, writes: torch.Tensor, group: Group) -> torch.Tensor:
    """The state each local segment starts from: ``transitions [n_local, B, H, dk, dk]`` (A)
    and ``writes [n_local, B, H, dk, dv]`` (B) of this rank's segments ->
    ``[n_local, B, H, dk, dv]``, composing every segment before it in sequence order."""
    cp = group_size(group)
    if cp == 1:
        return torch.zeros_like(writes)
    dk = transitions.shape[-1]
    both = all_gather(torch.cat([transitions, writes], dim=-1), group, dim=0)  # [2cp, B, H, dk, dk+dv]
    A, B = _in_sequence_order(both, cp).split([dk, writes.shape[-1]], dim=-1)
    states = [torch.zeros_like(writes[0])]
    for i in range(2 * cp - 1):
        states.append(A[i] @ states[-1] + B[i])  # the state after segment i
    return torch.stack([states[i] for _, _, i in local_segments(2, group)])
