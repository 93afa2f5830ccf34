"""Rotary position embeddings (Su et al. 2021) in the Hugging Face Mixtral/Qwen convention:
frequencies over the two halves of ``head_dim`` and ``rotate_half``, so weights imported
from Hugging Face give the same logits.

Positions come in as a tensor rather than ``arange(S)``: under context parallel a rank
holds non-contiguous chunks of the sequence (zigzag), and packed documents may restart
their positions.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as DeepSeek-V3 and
Hugging Face compute it: each frequency is blended between the original one
(extrapolation, fast-rotating dims) and the one divided by ``factor`` (interpolation,
slow dims) by a linear ramp over the dims between the ``beta_fast`` and ``beta_slow``
rotation counts at the original context length; cos and sin are scaled by the attention
factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from moe_fold.config import ModelConfig, require, rotary_pairs


@dataclass(frozen=True)
class YaRN:
    """YaRN rotary scaling (``model.rope_scaling: yarn`` and the ``model.yarn_*`` keys)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    # Round the correction range out to whole dims (DeepSeek-V3); gpt-oss keeps it fractional.
    truncate: bool = True

    def attention_factor(self) -> float:
        """The scale of cos and sin."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """What MLA multiplies its softmax scale by: ``mscale(factor, mscale_all_dim)^2`` (1 when unset)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, dim: int, theta: float, device=None) -> torch.Tensor:
        """``[dim/2]`` blended inverse frequencies."""
        pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            # The dim whose wavelength fits `rotations` times into the original context.
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return interpolation * ramp + extrapolation * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_of(m: ModelConfig) -> Optional[YaRN]:
    """The YaRN scaling of a model config, None without rotary scaling."""
    if m.rope_scaling != "yarn":
        return None
    return YaRN(m.yarn_factor, m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow,
                m.yarn_mscale, m.yarn_mscale_all_dim, m.yarn_truncate)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype = torch.float32,
                   yarn: Optional[YaRN] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for ``positions`` ``[S]`` or ``[B, S]`` -> ``[S, head_dim]`` or
    ``[B, S, head_dim]``, computed in float32 and returned in ``dtype``; ``head_dim`` is
    the width of the rotated part, ``yarn`` an optional frequency scaling."""
    require(rotary_pairs, head_dim)
    return cos_sin(positions, head_dim, theta, dtype, yarn)


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
            yarn: Optional[YaRN]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_cos_sin` of a ``head_dim`` already checked (when the model was built):
    tensor work only, what a forward calls."""
    if yarn is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                                dtype=torch.float32) / head_dim)  # [head_dim/2]
    else:
        inv_freq = yarn.inv_freq(head_dim, theta, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., S, head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [..., S, head_dim]
    cos, sin = angles.cos(), angles.sin()
    if yarn is not None:
        cos, sin = cos * yarn.attention_factor(), sin * yarn.attention_factor()
    return cos.to(dtype), sin.to(dtype)


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


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., (x0, x1), (x2, x3), ...]`` -> ``[..., x0, x2, ..., x1, x3, ...]``: rotary dims
    that come in interleaved pairs (``model.rope_interleave``: DeepSeek's, ERNIE-4.5's and Llama-4's
    checkpoints) as the two halves :func:`apply_rotary` rotates. The same permutation of q
    and k leaves every q.k product as it was."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, S, head_dim]`` by ``cos``/``sin`` from :func:`rotary_cos_sin`
    (no gradient flows to them: they are functions of the positions)."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    return _Rotary.apply(x, cos.detach(), sin.detach())
