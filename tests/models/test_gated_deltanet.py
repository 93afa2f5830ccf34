"""The chunked gated delta rule and the causal conv1d against a float64 token-by-token
reference, forward and gradients, with and without packed documents."""

from __future__ import annotations

import pytest
import torch

from moe_fold.kernels.gated_delta import causal_conv1d, chunk_gated_delta_rule
from tests.helpers.float64_reference import assert_close_to_float64


def recurrent_reference(q, k, v, g, beta, resets=None, initial_state=None):
    """The recurrence one token at a time (the definition the chunked form must equal);
    ``g [B, H, S]`` decays a head's whole state, ``g [B, H, S, dk]`` each key row of it."""
    B, H, S, dk = k.shape
    state = q.new_zeros(B, H, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(S):
        if resets is not None:
            state = state * (~resets[:, t]).to(state.dtype)[:, None, None, None]
        decay = g[:, :, t].exp()
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t]
        delta = (vt - torch.einsum("bhkv,bhk->bhv", state, kt)) * bt[..., None]
        state = state + kt[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outs, dim=2), state


def conv_reference(x, weight, doc_ids=None):
    """Each token's window read element by element, zero outside its document."""
    S, B, C = x.shape
    K = weight.shape[1]
    out = torch.zeros_like(x)
    for t in range(S):
        for i in range(K):
            src = t - (K - 1) + i
            if src < 0:
                continue
            keep = torch.ones(B, dtype=x.dtype) if doc_ids is None else (doc_ids[:, src] == doc_ids[:, t]).to(x.dtype)
            out[t] += weight[:, i] * x[src] * keep[:, None]
    return out


def _inputs(B=2, H=3, S=37, dk=5, dv=7, seed=0, decay="head"):
    """``decay``: head (a log-decay per head and token, Gated DeltaNet) or channel (one per
    key channel, KDA), spread so that channels decay at very different rates."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, H, S, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, S, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, S, dv, generator=gen, dtype=torch.float64)
    shape = (B, H, S) if decay == "head" else (B, H, S, dk)
    g = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.7
    if decay == "channel":
        g = g * torch.logspace(-2, 0.5, dk, dtype=torch.float64)
    beta = torch.rand(B, H, S, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _resets(B, S, starts):
    resets = torch.zeros(B, S, dtype=torch.bool)
    for b, cols in enumerate(starts):
        resets[b, cols] = True
    return resets


def _check(got, want, grads_got, grads_want):
    assert_close_to_float64(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkvgb", grads_got, grads_want):
        assert_close_to_float64(a, b, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_recurrent_forward_and_grads(chunk, packed, decay):
    inputs = _inputs(decay=decay)
    B, S = inputs[0].shape[0], inputs[0].shape[2]
    # Starts inside a chunk, on a chunk edge (16) and at the last token.
    resets = _resets(B, S, [[0, 5, 16, 36], [0, 9, 10, 30]]) if packed else None
    init = torch.randn(B, 3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, want_state = recurrent_reference(*inputs, resets=resets, initial_state=init)
    probe = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * probe).sum() + want_state.sum(), inputs)

    f32 = [t.detach().float().requires_grad_() for t in inputs]
    got, got_state = chunk_gated_delta_rule(*f32, resets=resets, initial_state=init.float(), chunk_size=chunk)
    grads_got = torch.autograd.grad((got * probe.float()).sum() + got_state.sum(), f32)
    _check(got, want, grads_got, grads_want)
    assert_close_to_float64(got_state, want_state.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_packed_equals_each_document_alone(decay):
    """A packed row gives each document what the recurrence gives it run alone from a
    zero state."""
    q, k, v, g, beta = (t.detach().float() for t in _inputs(B=1, S=30, decay=decay))
    bounds = [0, 7, 19, 30]
    resets = _resets(1, 30, [bounds[:-1]])
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, resets=resets, chunk_size=8)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        alone, _ = chunk_gated_delta_rule(*(t[:, :, lo:hi] for t in (q, k, v, g, beta)), chunk_size=8)
        torch.testing.assert_close(packed[:, :, lo:hi], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d(packed):
    gen = torch.Generator().manual_seed(1)
    S, B, C, K = 13, 2, 6, 4
    x = torch.randn(S, B, C, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, generator=gen, requires_grad=True)
    doc_ids = None
    if packed:
        doc_ids = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [3] * 1 + [4] * 12])
    want = conv_reference(x, w, doc_ids)
    hist_ids = None if doc_ids is None else torch.cat([doc_ids[:, :1].expand(B, K - 1) - 100, doc_ids], 1)
    got = causal_conv1d(x.float(), w.float(), doc_ids=hist_ids)
    assert_close_to_float64(got, want.detach())
    probe = torch.randn_like(want)
    gw = torch.autograd.grad((want * probe).sum(), (x, w))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    gg = torch.autograd.grad((causal_conv1d(xf, wf, doc_ids=hist_ids) * probe.float()).sum(), (xf, wf))
    for a, b in zip(gg, gw):
        assert_close_to_float64(a, b)


def test_causal_conv1d_history_continues_the_sequence():
    """Split in two with the first part's tail as history: the same as one pass."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 2, 5, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    whole = causal_conv1d(x, w)
    second = causal_conv1d(x[6:], w, history=x[3:6])
    torch.testing.assert_close(second, whole[6:])


def _hf_qwen3_next_config():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(vocab_size=32, hidden_size=20, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=4,
                           layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6)


def _our_config():
    from moe_fold.config import ModelConfig
    return ModelConfig(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.25,
                       linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
                       linear_conv_kernel=4, linear_chunk_size=4, attn_output_gate=True, norm_zero_centred=True,
                       qk_norm=True, norm_eps=1e-6)


def _by_key_head(w, nk, sizes):
    """Hugging Face groups the fused rows by key head ([q_h, k_h, v_h.., z_h..] per head h);
    ours are part-major ([q, k, v, z]): the same rows regrouped."""
    per_head = w.view(nk, sum(sizes), -1).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in per_head])


def test_gated_deltanet_equals_transformers_qwen3_next():
    """Our layer with Qwen3-Next's weights gives transformers' Qwen3NextGatedDeltaNet output."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    from moe_fold.models.gated_deltanet import GatedDeltaNet
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(_hf_qwen3_next_config(), 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(_our_config(), None, False, seed=0, name="l")
    nk, dk, r, dv = 2, 6, 2, 5
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([
            _by_key_head(hf.in_proj_qkvz.weight, nk, [dk, dk, r * dv, r * dv]),
            _by_key_head(hf.in_proj_ba.weight, nk, [r, r])]))
        ours.conv_weight.copy_(hf.conv1d.weight.squeeze(1))
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.norm_weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    x = torch.randn(2, 13, 20)
    want = hf(x)
    got = ours(x.transpose(0, 1), None, None).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gated_attention_and_zero_centred_norm_equal_transformers_qwen3_next():
    """Our attention with the output gate and zero-centred QK-norms gives transformers'
    Qwen3NextAttention output; our zero-centred RMSNorm its Qwen3NextRMSNorm."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding)
    from moe_fold.models.attention import Attention
    from moe_fold.models.norm import RMSNorm
    from moe_fold.models.rotary import rotary_cos_sin
    torch.manual_seed(1)
    config = _hf_qwen3_next_config()
    config._attn_implementation = "eager"
    hf = Qwen3NextAttention(config, 1)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = Attention(_our_config(), 8, None, False, seed=0, name="l", layer=1)
    heads, hd = 4, 8
    with torch.no_grad():
        q, gate = hf.q_proj.weight.view(heads, 2, hd, -1).unbind(1)  # per head: q rows, then gate rows
        ours.qkv.weight.copy_(torch.cat([q.reshape(-1, 20), gate.reshape(-1, 20), hf.k_proj.weight,
                                         hf.v_proj.weight]))
        ours.proj.weight.copy_(hf.o_proj.weight)
        ours.q_norm.weight.copy_(hf.q_norm.weight)
        ours.k_norm.weight.copy_(hf.k_norm.weight)
    S = 11
    x = torch.randn(2, S, 20)
    positions = torch.arange(S)[None].expand(2, -1)
    cos_sin = Qwen3NextRotaryEmbedding(config)(x, positions)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    want, _ = hf(x, cos_sin, mask)
    # Qwen3-Next rotates the first quarter of each head.
    rope = config.rope_parameters
    cos, sin = rotary_cos_sin(torch.arange(S), int(hd * rope["partial_rotary_factor"]), rope["rope_theta"],
                              torch.float32, None)
    got = ours(x.transpose(0, 1), cos, sin).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    norm_hf = Qwen3NextRMSNorm(20, 1e-6)
    norm = RMSNorm(20, 1e-6, zero_centred=True)
    with torch.no_grad():
        norm_hf.weight.normal_()
        norm.weight.copy_(norm_hf.weight)
    torch.testing.assert_close(norm(x), norm_hf(x))


@pytest.mark.parametrize("field, value, why", [
    ("layer_types", ["gated_deltanet", "attention", "attention", "attention"],
     r"mixtral has attention on every layer \(Qwen3-Next and Qwen3.5 have Gated DeltaNet layers, Kimi-Linear KDA"),
    ("attn_output_gate", True, "attention has no output gate"),
    ("norm_zero_centred", True, "RMSNorm weights are not zero-centred"),
])
def test_export_refuses_qwen3_next_layers(field, value, why):
    """A family without these layers refuses them, naming the field; they export as Qwen3-Next."""
    from moe_fold.config import Config
    from moe_fold.models.hf.config_map import HFConfigError, config_to_hf, export_family
    config = Config()
    setattr(config.model, field, value)
    with pytest.raises(HFConfigError, match=f"model.{field}=.*{why}"):
        config_to_hf(config, "mixtral")
    assert export_family(config) == "qwen3_next"


@pytest.mark.parametrize("overrides, problem", [
    (dict(layer_types=["gated_deltanet"]), "model.layer_types has 1 entries; it must have one per layer"),
    (dict(layer_types=["mamba"] * 4),
     "model.layer_types[0]='mamba' must be one of attention, gated_deltanet, kda, mamba2, mlp, moe"),
    (dict(layer_types=["gated_deltanet"] * 4, linear_num_value_heads=3),
     "model.linear_num_value_heads=3 must be a multiple of model.linear_num_key_heads=2"),
])
def test_layer_type_rules(overrides, problem):
    from moe_fold.config import Config, ConfigError, validate
    config = Config()
    for key, value in overrides.items():
        setattr(config.model, key, value)
    with pytest.raises(ConfigError) as err:
        validate(config, 1)
    assert problem in str(err.value)


def test_cp_segments_must_hold_the_conv_window():
    from moe_fold.config import Config, ConfigError, validate
    config = Config()
    config.model.layer_types, config.model.seq_length, config.parallel.cp = ["gated_deltanet"] * 4, 8, 4
    with pytest.raises(ConfigError, match="gives 1 tokens each; the short conv window of Gated DeltaNet and KDA needs at least"):
        validate(config, 4)
