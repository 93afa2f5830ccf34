"""Routing: router logits -> each token's experts and weights, with Megatron-Core's semantics.

Pure functions (plain tensors in, tensors out):

- :func:`topk_routing`: scores (softmax before or after top-k, sigmoid), group-limited
  top-k (DeepSeek-V3), scaling factor, aux-loss-free expert bias;
- :func:`expert_capacity` / :func:`apply_capacity`: token dropping with the ``probs`` or
  ``position`` policy, optionally padding every expert to exactly its capacity;
- :func:`updated_expert_bias`: one aux-loss-free bias step.

Ties are broken towards the lower index everywhere (expert index in top-k, group index in
group selection, token index in capacity dropping), so a kernel and a loop reference agree
on equal scores. ``torch.topk`` leaves that order unspecified, hence the stable sorts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = [
    "SCORE_FUNCTIONS", "DROP_POLICIES",
    "check_routing_args", "topk_routing", "expert_capacity", "apply_capacity", "updated_expert_bias",
]

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def check_routing_args(
    num_experts: int,
    topk: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: bool = False,
) -> None:
    """Raise ValueError naming the argument, its value and the rule it breaks."""
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk!r} must be an int with 1 <= topk <= num_experts={num_experts}")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"score={score!r} is not a known score function; use one of {SCORE_FUNCTIONS}")
    if pre_softmax and score != "softmax":
        raise ValueError(f"pre_softmax=True applies only to score='softmax', got score={score!r}")
    if expert_bias and score != "sigmoid":
        raise ValueError(f"expert_bias needs score='sigmoid' (selection uses score + bias), got score={score!r}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError(f"num_groups={num_groups!r} and group_topk={group_topk!r} must be set together")
    if num_groups is not None:
        if num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups} must be >= 1 and divide num_experts={num_experts}")
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk={group_topk} must satisfy 1 <= group_topk <= num_groups={num_groups}")
        if topk % group_topk:
            raise ValueError(f"topk={topk} must be divisible by group_topk={group_topk} "
                             "(a group scores the sum of its top topk/group_topk experts)")
        if topk // group_topk > num_experts // num_groups:
            raise ValueError(f"topk/group_topk={topk // group_topk} exceeds the "
                             f"{num_experts // num_groups} experts of a group")
    if scaling_factor is not None and not (math.isfinite(scaling_factor) and scaling_factor > 0):
        raise ValueError(f"scaling_factor={scaling_factor!r} must be a finite number > 0 (or None)")


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Ties go to the lower index (see the module docstring).
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _select(scores: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values and expert indices per token, optionally limited to the best groups."""
    if group_topk is None:
        return _stable_topk(scores, topk)
    num_tokens, num_experts = scores.shape
    per_group = num_experts // num_groups
    # [T, E] -> [T, groups, E/groups] -> [T, groups]
    group_scores = _stable_topk(scores.view(num_tokens, num_groups, per_group), topk // group_topk)[0].sum(-1)
    best = _stable_topk(group_scores, group_topk)[1]
    eligible = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    eligible.scatter_(1, best, True)
    # [T, groups] -> [T, E]
    eligible = eligible.repeat_interleave(per_group, dim=1)
    return _stable_topk(scores.masked_fill(~eligible, float("-inf")), topk)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to ``topk`` experts.

    Args:
        logits: ``[T, E]`` router logits.
        score: ``softmax`` or ``sigmoid``.
        pre_softmax: softmax only. True: softmax over all experts, then top-k (the probs are
            those softmax values, not renormalised). False (default): top-k of the logits,
            then softmax over the k chosen logits.
        num_groups, group_topk: group-limited routing. Experts form ``num_groups`` equal
            groups; a group scores the sum of its top ``topk/group_topk`` scores (logits for
            post-softmax); only the best ``group_topk`` groups are eligible.
        scaling_factor: multiplies the final probs.
        expert_bias: ``[E]``, sigmoid only. Selection uses ``sigmoid + bias``; the probs use
            the unbiased sigmoid. With k > 1 sigmoid probs are normalised over the k chosen.

    Returns:
        ``probs [T, E]`` (float32, or float64 for float64 logits; zero off the chosen
        experts; differentiable w.r.t. ``logits``) and ``routing_map [T, E]`` bool with
        exactly ``topk`` True per row.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    check_routing_args(num_experts, topk, score=score, pre_softmax=pre_softmax, num_groups=num_groups,
                       group_topk=group_topk, scaling_factor=scaling_factor,
                       expert_bias=expert_bias is not None)
    if expert_bias is not None and tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"expert_bias must have shape ({num_experts},), got {tuple(expert_bias.shape)}")
    work = logits if logits.dtype == torch.float64 else logits.float()

    if score == "softmax":
        if pre_softmax:
            probs, top = _select(torch.softmax(work, dim=-1), topk, num_groups, group_topk)
        else:
            top_logits, top = _select(work, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(work)
        if expert_bias is not None:
            top = _select(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)[1]
            probs = scores.gather(1, top)
        else:
            probs, top = _select(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        probs = probs * scaling_factor

    # [T, k] -> [T, E]
    dense = torch.zeros_like(work).scatter(1, top, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, top, True)
    return dense, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert accepts: ``ceil(T * k / E * capacity_factor)`` (Megatron's order of
    operations, so float rounding gives the same integer)."""
    if not (isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0")
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity_factor: float,
    *,
    policy: str = "probs",
    pad_to_capacity: bool = False,
    topk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the assignments beyond each expert's capacity.

    Capacity is :func:`expert_capacity` of ``T`` tokens with ``topk`` experts each (``topk``
    is read from ``routing_map`` when not given, which costs a host sync). Policy ``probs``
    keeps each expert's highest-prob tokens, ``position`` its earliest tokens; ties keep the
    earlier token. With ``pad_to_capacity`` every expert gets exactly ``min(capacity, T)``
    slots: its kept tokens, then the earliest tokens not routed to it, with prob 0 (so the
    dispatcher moves fixed-size blocks).

    Returns ``(probs * kept, kept)`` with ``kept [T, E]`` bool.
    """
    if probs.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} "
                         "must both be [tokens, experts]")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map must be bool, got {routing_map.dtype}")
    if policy not in DROP_POLICIES:
        raise ValueError(f"policy={policy!r} is not a drop policy; use one of {DROP_POLICIES}")
    num_tokens, num_experts = probs.shape
    if topk is None:
        per_token = routing_map.sum(dim=1)
        topk = int(per_token[0]) if num_tokens else 1
        if num_tokens and not bool((per_token == topk).all()):
            raise ValueError("routing_map rows choose different numbers of experts; pass topk=")
    capacity = min(expert_capacity(num_tokens, num_experts, topk, capacity_factor), num_tokens)

    # Routed tokens sort before the others (probs are >= 0 > -1); the stable sort keeps
    # equal keys in token order.
    if policy == "probs":
        key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0))
    else:
        key = routing_map.to(probs.dtype)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]  # [capacity, E]
    kept = torch.zeros_like(routing_map).scatter_(0, order, True)
    if not pad_to_capacity:
        kept &= routing_map
    return probs * kept, kept


def updated_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """One aux-loss-free balancing step: ``b + rate * sign(mean(count) - count)``.

    ``tokens_per_expert`` must already be summed over every rank that shares the router
    (tp x dp x cp) and over the step's micro-batches.
    """
    counts = tokens_per_expert.to(torch.float64)
    offset = counts.mean() - counts
    return expert_bias + (rate * torch.sign(offset)).to(expert_bias.dtype)
