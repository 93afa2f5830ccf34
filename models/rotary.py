"""Rotary position embeddings (Su et al. 2021) in the Hugging Face Mixtral/Qwen convention:
frequencies over the two halves of ``head_dim`` and ``rotate_half``, so weights imported
from Hugging Face give the same logits.

Positions come in as a tensor rather than ``arange(S)``: under context parallel a rank
holds non-contiguous chunks of the sequence (zigzag), and packed documents may restart
their positions.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` ``[S]`` or ``[B, S]`` -> ``[S, head_dim]`` or
    ``[B, S, head_dim]``, computed in float32 and returned in ``dtype``."""
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)  # [head_dim/2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., S, head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [..., S, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``x * cos + sign * rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``,
    written into one output: two passes, where the plain formula (a negation, a cat, two
    products and a sum) makes five and its autograd backward five more."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=sign)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # The rotation's transpose: [y1, y2] -> [y1 cos1 + y2 sin2, y2 cos2 - y1 sin1].
        half = grad.shape[-1] // 2
        out = grad * cos
        out[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        out[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1.0)
        return out, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, S, head_dim]`` by ``cos``/``sin`` from :func:`rotary_cos_sin`
    (no gradient flows to them: they are functions of the positions)."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    return _Rotary.apply(x, cos.detach(), sin.detach())
