"""Load statistics of one routing decision, for logging (cheap: a few reductions over [E]).

Counts may be one rank's or already summed over ranks; the ratios are computed from the
counts given, so a logger that wants the global picture sums the counts first and calls
:func:`routing_stats` again.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch

from moe_fold.config import experts_over_ep, require

__all__ = ["RoutingStats", "routing_stats", "load_stats"]


@dataclass
class RoutingStats:
    # [E] assignments each expert received, after capacity dropping (padding slots excluded).
    tokens_per_expert: torch.Tensor
    # Share of the routed assignments that capacity dropped.
    dropped_fraction: torch.Tensor
    # max / mean of tokens_per_expert: 1 is perfect balance, E is everything on one expert.
    expert_load_ratio: torch.Tensor
    # The same over EP ranks, each holding E/ep consecutive experts.
    ep_load_ratio: torch.Tensor
    # Assignments to zero-computation experts (moe.zero_experts), kept apart: no rank holds
    # them, so they are in none of the loads above (0 without zero experts).
    zero_expert_tokens: torch.Tensor


def _max_over_mean(x: torch.Tensor) -> torch.Tensor:
    mean = x.mean()
    return torch.where(mean > 0, x.max() / mean.clamp(min=1e-30), torch.ones_like(mean))


def routing_stats(routed_per_expert: torch.Tensor, kept_per_expert: torch.Tensor, ep: int = 1,
                  zero_expert_tokens: Optional[torch.Tensor] = None) -> RoutingStats:
    """Statistics from per-expert counts before (``routed``) and after (``kept``) capacity,
    of the held experts; ``zero_expert_tokens``: the assignments to zero experts."""
    if routed_per_expert.dim() != 1 or routed_per_expert.shape != kept_per_expert.shape:
        raise ValueError(f"routed {tuple(routed_per_expert.shape)} and kept {tuple(kept_per_expert.shape)} "
                         "counts must both be [experts]")
    num_experts = routed_per_expert.shape[0]
    if ep < 1:
        raise ValueError(f"ep={ep} must be >= 1")
    require(experts_over_ep, num_experts, ep)
    return load_stats(routed_per_expert, kept_per_expert, ep, zero_expert_tokens)


def load_stats(routed_per_expert: torch.Tensor, kept_per_expert: torch.Tensor, ep: int,
               zero_expert_tokens: Optional[torch.Tensor] = None) -> RoutingStats:
    """:func:`routing_stats` of counts already known to fit (E over ep checked when the
    router was built): tensor work only, what a forward calls."""
    num_experts = routed_per_expert.shape[0]
    routed = routed_per_expert.double()
    kept = kept_per_expert.double()
    total = routed.sum()
    dropped = torch.where(total > 0, 1 - kept.sum() / total.clamp(min=1), torch.zeros_like(total))
    # [E] -> [ep, E/ep] -> [ep]
    per_rank = kept.view(ep, num_experts // ep).sum(dim=1)
    zero = (torch.zeros((), dtype=torch.float64, device=kept.device) if zero_expert_tokens is None
            else zero_expert_tokens.double())
    return RoutingStats(kept, dropped, _max_over_mean(kept), _max_over_mean(per_rank), zero)
