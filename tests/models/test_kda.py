"""The KDA layer (models/kda.py) against transformers' Kimi-Linear KDA layer, with packed
documents, and its config rules. The per-channel chunked rule itself is tested against
the float64 token-by-token reference in tests/models/test_gated_deltanet.py."""

from __future__ import annotations

import pytest
import torch

from moe_fold.config import Config, ConfigError, ModelConfig, validate
from moe_fold.models.kda import KimiDeltaAttention
from moe_fold.parallel.varlen import Documents

H, HEADS, D = 19, 3, 7  # odd sizes


def _hf_config():
    from transformers import KimiLinearConfig
    return KimiLinearConfig(vocab_size=32, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                            linear_num_heads=HEADS, linear_head_dim=D, linear_conv_kernel_dim=4,
                            layer_types=["linear_attention", "full_attention"], rms_norm_eps=1e-6)


def _our_config(chunk: int = 4) -> ModelConfig:
    return ModelConfig(hidden_size=H, linear_num_key_heads=HEADS, linear_num_value_heads=HEADS,
                       linear_key_head_dim=D, linear_value_head_dim=D, linear_conv_kernel=4,
                       linear_chunk_size=chunk, norm_eps=1e-6)


def load_hf_kda(ours: KimiDeltaAttention, hf) -> None:
    """transformers' KDA tensors into ours (the family's weight map, written out)."""
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight,
                                             hf.b_proj.weight]))
        ours.gates_down.weight.copy_(torch.cat([hf.forget_gate.f_a_proj.weight, hf.g_a_proj.weight]))
        ours.decay_up.weight.copy_(hf.forget_gate.f_b_proj.weight)
        ours.gate_up.weight.copy_(hf.g_b_proj.weight)
        ours.conv_weight.copy_(hf.conv1d.weight.squeeze(1))
        ours.A_log.copy_(hf.forget_gate.A_log.flatten())
        ours.dt_bias.copy_(hf.forget_gate.dt_bias)
        ours.norm_weight.copy_(hf.o_norm.weight)
        ours.out_proj.weight.copy_(hf.o_proj.weight)


def _pair(chunk: int = 4):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(_hf_config(), 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        # Decays from slow to fast across heads and channels.
        hf.forget_gate.A_log.copy_(torch.linspace(-3, 1, HEADS).view(1, 1, HEADS, 1))
        hf.forget_gate.dt_bias.copy_(torch.linspace(-4, 1, HEADS * D))
    ours = KimiDeltaAttention(_our_config(chunk), None, False, seed=0, name="l")
    load_hf_kda(ours, hf)
    return ours, hf


@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_kda_equals_transformers_kimi_linear(chunk):
    """Our layer with Kimi-Linear's weights gives transformers' KimiLinearDeltaAttention output
    (its torch chunked path), whatever our chunk size."""
    ours, hf = _pair(chunk)
    x = torch.randn(2, 13, H)
    want = hf(x)
    got = ours(x.transpose(0, 1), None, None).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kda_decode_continues_the_sequence():
    """Sampling: a prefill then one token at a time from the cache gives the full forward's
    outputs (the conv window and the per-channel state carried)."""
    from moe_fold.models.kv_cache import LayerCache
    ours, _ = _pair()
    x = torch.randn(11, 2, H)
    with torch.no_grad():
        whole = ours(x, None, None)
        cache = LayerCache()
        steps = []
        for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 11)):
            cache.new_tokens = hi - lo
            # A decode step's padding row after its real tokens must not enter the state.
            padded = torch.cat([x[lo:hi], torch.randn(1, 2, H)])
            steps.append(ours(padded, None, None, kv_cache=cache)[:hi - lo])
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-5, atol=1e-6)


def test_packed_kda_equals_each_document_alone():
    """A packed row's outputs are those of each document run alone (the conv window and the
    state reset at every document start)."""
    ours, _ = _pair()
    with torch.no_grad():
        ours.A_log.fill_(-4.0)  # slow decays: a state not reset would show
    x = torch.randn(17, 1, H)
    ids = torch.tensor([[0] * 5 + [1] * 1 + [2] * 8 + [3] * 3])
    with torch.no_grad():
        packed = ours(x, None, None, Documents(ids, None))
        for doc in ids[0].unique():
            cols = (ids[0] == doc).nonzero().flatten()
            alone = ours(x[cols], None, None)
            torch.testing.assert_close(packed[cols], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, problem", [
    (dict(linear_num_value_heads=4), "model.linear_num_value_heads=4 must equal model.linear_num_key_heads=2 "
                                     "with kda layers"),
    (dict(linear_value_head_dim=16), "model.linear_value_head_dim=16 must equal model.linear_key_head_dim=32 "
                                     "with kda layers"),
])
def test_kda_rules(overrides, problem):
    config = Config()
    config.model.layer_types = ["kda", "attention", "kda", "kda"]
    config.model.linear_num_value_heads = 2
    for key, value in overrides.items():
        setattr(config.model, key, value)
    with pytest.raises(ConfigError) as err:
        validate(config, 1)
    assert problem in str(err.value)
