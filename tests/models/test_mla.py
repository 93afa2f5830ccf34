"""Multi-head latent attention: the config rules and their messages, YaRN against
transformers' own frequencies, the MLA layer against a float64 formula written here from
the DeepSeek-V3 report, and the attention kernels with a value head width different
from the query/key one (what MLA needs from the cp paths). Layouts (tp + SP, cp ring and
a2a with packed documents, pp with vpp, ep, etp, dynamic cp) are in the layout-invariance
tests, which run MLA_MODEL beside standard attention; Hugging Face DeepSeek-V3 in
tests/models/hf/test_families.py."""

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moe_fold.config import Config, ConfigError, ModelConfig, validate
from moe_fold.layout import ProcessGroups
from moe_fold.config import mla_weight_shapes
from moe_fold.models.mla import MLAttention
from moe_fold.models.rotary import YaRN, rotary_cos_sin, yarn_of
from moe_fold.parallel.varlen import sdpa, varlen_attention
from moe_fold.parallel.ring_attention import (
    block_attention_backward, block_attention_forward,
)

# MLA at test sizes (used by the layout-invariance tests too): 4 heads, q/kv ranks 12/10,
# qk 6 + 4, v 5, interleaved rotary pairs, YaRN with a softmax mscale.
MLA_MODEL = dict(attention="mla", num_kv_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                 qk_rope_head_dim=4, v_head_dim=5, rope_interleave=True, rope_scaling="yarn", yarn_factor=2.0,
                 yarn_original_max_position_embeddings=8, yarn_mscale=1.0, yarn_mscale_all_dim=0.7)


def _problems(**model) -> list[str]:
    config = Config()
    for key, value in model.items():
        setattr(config.model, key, value)
    try:
        validate(config, 1)
    except ConfigError as err:
        return err.problems
    return []


def test_mla_config_validates():
    assert _problems(**MLA_MODEL) == []
    assert _problems(**dict(MLA_MODEL, q_lora_rank=None, rope_scaling=None, yarn_factor=None,
                            yarn_original_max_position_embeddings=None, yarn_mscale=None,
                            yarn_mscale_all_dim=None)) == []


@pytest.mark.parametrize("change,message", [
    (dict(attention="gqa"), "model.attention=gqa must be one of mha, mla"),
    (dict(kv_lora_rank=None), "model.kv_lora_rank=null must be set when model.attention=mla"),
    (dict(v_head_dim=0), "model.v_head_dim=0 must be >= 1"),
    (dict(q_lora_rank=0), "model.q_lora_rank=0 must be >= 1"),
    (dict(qk_rope_head_dim=5), "model.qk_rope_head_dim=5 must be even (rotary pairs)"),
    (dict(num_kv_heads=2), "model.num_kv_heads=2 must equal model.num_heads=4 when model.attention=mla "
                           "(every head has its own key and value)"),
    (dict(qk_norm=True), "model.qk_norm and model.qkv_bias must be false when model.attention=mla"),
    (dict(head_dim=8), "model.head_dim=8 must be null when model.attention=mla (MLA's head widths are "
                       "model.qk_nope_head_dim, model.qk_rope_head_dim and model.v_head_dim)"),
    (dict(rope_scaling="ntk"), "model.rope_scaling=ntk must be one of yarn"),
    (dict(yarn_factor=None), "model.yarn_factor=null must be set when model.rope_scaling=yarn"),
    (dict(yarn_factor=0.5), "model.yarn_factor=0.5 must be >= 1"),
    (dict(yarn_original_max_position_embeddings=None),
     "model.yarn_original_max_position_embeddings=null must be set when model.rope_scaling=yarn"),
    (dict(yarn_beta_fast=0.5), "model.yarn_beta_fast=0.5 must be >= model.yarn_beta_slow=1.0"),
    (dict(yarn_beta_slow=0.0), "model.yarn_beta_slow=0.0 must be > 0"),
    (dict(yarn_mscale_all_dim=-1.0), "model.yarn_mscale_all_dim=-1.0 must be >= 0"),
    (dict(rope_scaling=None), "model.yarn_factor=2.0 is set but model.rope_scaling is null"),
    (dict(attention_out_bias=True),
     "model.attention_out_bias=true requires model.attention=mha (MLA's output projection has no bias)"),
    (dict(attention_sinks=True), "model.attention_sinks=true requires model.attention=mha (MLA's attention does not "
                                 "take it)"),
    (dict(sliding_window=4), "model.sliding_window=4 requires model.attention=mha (MLA's attention does not take it)"),
])
def test_mla_config_rules(change, message):
    assert message in _problems(**{**MLA_MODEL, **change})


@pytest.mark.parametrize("change,message", [
    (dict(kv_lora_rank=16), "model.kv_lora_rank=16 is an MLA size: set model.attention=mla or leave it null"),
])
def test_mha_refuses_mla_settings(change, message):
    assert message in _problems(**change)


@pytest.mark.parametrize("params", [
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=16, beta_fast=16, beta_slow=2, mscale=0.9, mscale_all_dim=0.6),
    dict(factor=8.0, original_max_position_embeddings=64),
    # gpt-oss's: the correction range not truncated to whole dims.
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
])
def test_yarn_matches_transformers(params):
    hf = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=64 * 4096,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = YaRN(params["factor"], params["original_max_position_embeddings"], params.get("beta_fast", 32),
                params.get("beta_slow", 1), params.get("mscale"), params.get("mscale_all_dim"),
                params.get("truncate", True))
    torch.testing.assert_close(ours.inv_freq(64, 10000.0), inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor() == pytest.approx(factor, rel=1e-12)


def _formula(x, w, config, positions):
    """MLA in float64 straight from the report, for one sequence ``x [S, H]``, with the
    layer's global weights ``w`` (our names): the reference for :class:`MLAttention`.
    Interleaved rotary pairs are rotated in place, as DeepSeek's reference code does."""
    m = config.model
    nope, rope, vd, heads = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.num_heads

    def rms(t, weight):
        return weight * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + m.norm_eps)

    def rotate(t, cos, sin):  # interleaved pairs (t0, t1) rotated by one angle each
        t0, t1 = t[..., 0::2], t[..., 1::2]
        c, s = cos[..., : rope // 2], sin[..., : rope // 2]
        out = torch.empty_like(t)
        out[..., 0::2], out[..., 1::2] = t0 * c - t1 * s, t1 * c + t0 * s
        return out

    S = x.shape[0]
    if "q.weight" in w:
        q = x @ w["q.weight"].T  # [S, heads*(nope+rope)]
    else:
        q = rms(x @ w["q_down.weight"].T, w["q_norm.weight"]) @ w["q_up.weight"].T
    q = q.view(S, heads, nope + rope)
    kv = x @ w["kv_down.weight"].T  # [S, kv_lora + rope]
    c, k_rope = kv[:, :m.kv_lora_rank], kv[:, m.kv_lora_rank:]
    up = (rms(c, w["kv_norm.weight"]) @ w["kv_up.weight"].T).view(S, heads, nope + vd)
    yarn = yarn_of(m)
    cos, sin = rotary_cos_sin(positions, rope, m.rope_theta, torch.float64, yarn)  # [S, rope]
    q_rope = rotate(q[..., nope:], cos[:, None], sin[:, None])
    k_rope = rotate(k_rope, cos, sin)[:, None].expand(S, heads, rope)
    qh = torch.cat([q[..., :nope], q_rope], -1).transpose(0, 1)  # [heads, S, nope+rope]
    kh = torch.cat([up[..., :nope], k_rope], -1).transpose(0, 1)
    vh = up[..., nope:].transpose(0, 1)  # [heads, S, v]
    scale = yarn.softmax_mscale() / math.sqrt(nope + rope)
    scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf)
    out = (scores.softmax(-1) @ vh).transpose(0, 1).reshape(S, heads * vd)
    return out @ w["proj.weight"].T


@pytest.mark.parametrize("q_lora", [12, None])
def test_mla_layer_equals_the_formula(q_lora):
    config = Config()
    config.model = ModelConfig(hidden_size=24, num_heads=4, init_std=0.3, **dict(MLA_MODEL, q_lora_rank=q_lora))
    layer = MLAttention(config.model, None, False, seed=3, name="layers.0.attn").double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype) + 0.5)
    assert {k: tuple(p.shape) for k, p in layer.named_parameters() if not k.endswith("norm.weight")} == {
        f"{k}.weight": v for k, v in mla_weight_shapes(config.model).items()}
    w = {n: p.detach() for n, p in layer.named_parameters()}
    x = torch.randn(10, 2, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.arange(10)
    cos, sin = rotary_cos_sin(positions, 4, config.model.rope_theta, torch.float64, yarn_of(config.model))
    got = layer(x, cos, sin)  # [S, B, H]
    # Float32 tolerance: RMSNorm computes in float32 whatever the input dtype (as Hugging Face's).
    for b in range(2):
        torch.testing.assert_close(got[:, b], _formula(x[:, b], w, config, positions), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("d,dv", [(10, 5), (6, 11)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_takes_another_value_width(d, dv, causal):
    """The CPU block kernel (padded to one width) equals an explicit softmax, forward (out
    and log-sum-exp) and backward (autograd of the explicit softmax)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 6, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    out, lse = block_attention_forward(q.detach(), k.detach(), v.detach(), causal, 0.3)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3  # [B, Hq, S, S]
    if causal:
        scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
    ref_out = scores.softmax(-1) @ v.repeat_interleave(2, 1)
    assert out.shape == (2, 4, 6, dv)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, scores.logsumexp(-1).detach())
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for got, ref in zip(block_attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, 0.3),
                        torch.autograd.grad(ref_out, (q, k, v), dout)):
        torch.testing.assert_close(got, ref.to(got.dtype))


@pytest.mark.parametrize("d,dv", [(10, 5), (6, 11)])
def test_sdpa_and_varlen_take_another_value_width(d, dv):
    """One-rank attention pads to one width for the fused kernel and cuts back: equal to
    an explicit softmax (and the default scale stays 1/sqrt(d) when v is the wider)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 9, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 9, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    doc_ids = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])

    def reference(with_docs):
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        allowed = torch.ones(9, 9, dtype=torch.bool).tril()
        if with_docs:
            allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
        scores = (q @ kk.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, -math.inf)
        return scores.softmax(-1) @ vv

    for with_docs in (False, True):
        got = varlen_attention(q, k, v, doc_ids if with_docs else None)
        ref = reference(with_docs)
        assert got.shape == (2, 4, 9, dv)
        torch.testing.assert_close(got, ref)
        dout = torch.randn(got.shape, generator=gen, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(sdpa(q, k, v, is_causal=True, enable_gqa=True), reference(False))
