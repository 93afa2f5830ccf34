"""Random inputs for a token dispatcher: tokens, routing probs and a top-k routing map."""

from __future__ import annotations

import torch


def random_routing(num_tokens: int, hidden: int, num_experts: int, topk: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens[T, H]``, softmax ``probs[T, E]`` and the bool ``routing_map[T, E]`` of each
    token's ``topk`` highest scores, all from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, hidden, generator=gen)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(
        1, scores.topk(topk, dim=1).indices, True)
    return tokens, torch.softmax(scores, dim=1), routing_map
