"""Attention (models/attention.py): grouped-query attention with and without QK-norm against a
loop over batch rows and heads with rotary by pairs written out, at arbitrary positions."""

import math

import pytest
import torch

from moe_fold.models.attention import Attention

from tests.models.test_model import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, SEQ, _config


def _rotate_reference(x, pos, theta):
    """HF rotary by pairs (i, i + d/2) written out: x [S, d], pos [S]."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        angle = pos.double() * theta ** (-2.0 * i / d)
        c, s = torch.cos(angle).float(), torch.sin(angle).float()
        out[:, i] = x[:, i] * c - x[:, i + d // 2] * s
        out[:, i + d // 2] = x[:, i + d // 2] * c + x[:, i] * s
    return out


def _attention_reference(attn, x, pos, theta, eps, qk_norm):
    """Attention with explicit loops over batch rows and heads: x [S, B, H]."""
    S, B, _ = x.shape
    d, nq, nkv = HEAD_DIM, HEADS, KV_HEADS
    w = attn.qkv.weight
    wq, wk, wv = w[: nq * d], w[nq * d: (nq + nkv) * d], w[(nq + nkv) * d:]
    out = torch.zeros(S, B, nq * d)
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    for b in range(B):
        for h in range(nq):
            g = h // (nq // nkv)
            q = x[:, b] @ wq[h * d:(h + 1) * d].T  # [S, d]
            k = x[:, b] @ wk[g * d:(g + 1) * d].T
            v = x[:, b] @ wv[g * d:(g + 1) * d].T
            if qk_norm:
                q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * attn.q_norm.weight
                k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps) * attn.k_norm.weight
            q, k = _rotate_reference(q, pos, theta), _rotate_reference(k, pos, theta)
            scores = (q @ k.T / math.sqrt(d)).masked_fill(~causal, float("-inf"))
            out[:, b, h * d:(h + 1) * d] = torch.softmax(scores, -1) @ v
    return out @ attn.proj.weight.T


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_attention_matches_loop_reference(qk_norm):
    from moe_fold.models.rotary import rotary_cos_sin

    theta, eps = 500.0, 1e-5
    config = _config(qk_norm=qk_norm, theta=theta, eps=eps).model
    attn = Attention(config, HEAD_DIM, None, False, seed=5, name="attn")
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(SEQ, 2, HIDDEN)
    pos = torch.arange(SEQ) * 3 + 5  # arbitrary positions, as context parallel passes them
    cos, sin = rotary_cos_sin(pos, HEAD_DIM, theta)
    with torch.no_grad():
        got = attn(x, cos, sin)
        expected = _attention_reference(attn, x, pos, theta, eps, qk_norm)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
