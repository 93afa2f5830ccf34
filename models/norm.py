"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face Mixtral/Qwen do."""

from __future__ import annotations

import torch
from torch import nn

from moe_fold.tensor_parallel import mark


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim.

    ``parallel`` tells gradient sync how this replicated weight's grad relates across tp
    (see :mod:`moe_fold.tensor_parallel`): ``"replicated"`` when every tp rank normalises
    the same rows, ``"tp_sum"`` when each rank normalises different rows (its sequence
    shard under SP, or its own heads for QK-norm).
    """

    def __init__(self, dim: int, eps: float, parallel: str = "replicated"):
        super().__init__()
        self.eps = eps
        self.weight = mark(nn.Parameter(torch.ones(dim)), parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
