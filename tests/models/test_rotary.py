"""Rotary position embedding (models/rotary.py): the rotation of dims (i, i + d/2) by
position x theta^(-2i/d), its hand-written backward against autograd of the plain formula,
attention scores that depend on position differences only, the interleaved-pairs
permutation, YaRN's attention scale, and an odd width refused."""

import math

import pytest
import torch

from moe_fold.config import ConfigError
from moe_fold.models.rotary import apply_rotary, deinterleave, rotary_cos_sin, yarn_mscale


def _plain(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` as transformers writes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_rotation_by_pairs_and_its_backward():
    d, theta = 8, 500.0
    pos = torch.tensor([0, 3, 7, 100])
    cos, sin = rotary_cos_sin(pos, d, theta, dtype=torch.float64)
    # The angles are computed in float32 whatever the dtype: 100 rad within 1e-5.
    for i in range(d // 2):
        angle = pos.double() * theta ** (-2.0 * i / d)
        for half in (i, i + d // 2):
            torch.testing.assert_close(cos[:, half], angle.cos(), rtol=0, atol=1e-5)
            torch.testing.assert_close(sin[:, half], angle.sin(), rtol=0, atol=1e-5)
    x = torch.randn(2, 3, 4, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = apply_rotary(x, cos, sin)
    want = _plain(x, cos.unsqueeze(-3), sin.unsqueeze(-3))
    torch.testing.assert_close(got, want)
    grad = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (mine,) = torch.autograd.grad(got, x, grad)
    (ref,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(mine, ref)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


def test_scores_depend_on_position_differences_only():
    d = 16
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, d, dtype=torch.float64, generator=gen) for _ in range(2))

    def score(pq, pk):
        cq, sq = rotary_cos_sin(torch.tensor([pq]), d, 10000.0, dtype=torch.float64)
        ck, sk = rotary_cos_sin(torch.tensor([pk]), d, 10000.0, dtype=torch.float64)
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    # (float32 angles: equal within their rounding)
    assert score(9, 4) == pytest.approx(score(105, 100), rel=1e-5)
    assert score(9, 4) != pytest.approx(score(9, 5), rel=1e-3)


def test_deinterleave_yarn_scale_and_refusals():
    assert deinterleave(torch.arange(6)).tolist() == [0, 2, 4, 1, 3, 5]
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 2.0) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40.0) + 1.0)
    with pytest.raises(ConfigError, match="7"):
        rotary_cos_sin(torch.arange(4), 7, 10000.0)
