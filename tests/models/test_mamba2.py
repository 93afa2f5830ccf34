"""The Mamba2 layer: transformers' Nemotron-H mixer's output at odd sizes, packed documents
reset the conv window and the state, and the config's rules."""

from __future__ import annotations

import pytest
import torch

from moe_fold.config import Config, ConfigError, ModelConfig, validate
from moe_fold.models.mamba2 import Mamba2
from moe_fold.parallel.varlen import Documents


def _our_config(**overrides) -> ModelConfig:
    fields = dict(hidden_size=21, mamba_num_heads=6, mamba_head_dim=5, mamba_state_size=7, mamba_num_groups=3,
                  mamba_conv_kernel=4, mamba_chunk_size=4, norm_eps=1e-5, mamba_dt_min=0.001)
    fields.update(overrides)
    return ModelConfig(**fields)


def _hf_mixer():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    config = NemotronHConfig(vocab_size=32, hidden_size=21, layers_block_type=["linear_attention"],
                             mamba_num_heads=6, mamba_head_dim=5, ssm_state_size=7, n_groups=3, conv_kernel=4,
                             chunk_size=8, layer_norm_epsilon=1e-5, time_step_min=0.001)
    return NemotronHMamba2Mixer(config, 0)


def load_hf_mixer(ours: Mamba2, hf) -> None:
    """Transformers' mixer weights into ours: the same rows and channels (in_proj z|x|B|C|dt,
    conv x|B|C)."""
    with torch.no_grad():
        ours.in_proj.weight.copy_(hf.in_proj.weight)
        ours.conv_weight.copy_(hf.conv1d.weight.squeeze(1))
        ours.conv_bias.copy_(hf.conv1d.bias)
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(hf, name))
        ours.norm_weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)


def test_mamba2_equals_transformers_nemotron_h_mixer():
    """Our layer with a Nemotron-H mixer's weights gives transformers' torch path's output
    within 1e-5 in float32 (6 heads in 3 groups, head dim 5, state 7, 13 tokens)."""
    torch.manual_seed(0)
    hf = _hf_mixer()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.A_log.uniform_(-1, 1)
        hf.dt_bias[:2] = -8.0  # softplus below time_step_min: the clamp is exercised
    ours = Mamba2(_our_config(), None, False, seed=0, name="l")
    load_hf_mixer(ours, hf)
    x = torch.randn(2, 13, 21)
    want = hf(x)
    got = ours(x.transpose(0, 1), None, None).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _layer(seed=0, **overrides) -> Mamba2:
    layer = Mamba2(_our_config(**overrides), None, False, seed=seed, name="l")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Slow decays and a live conv bias and skip, so what crosses a boundary is visible.
        layer.A_log.fill_(-3.0)
        layer.conv_bias.normal_(generator=gen)
        layer.D.normal_(generator=gen)
    return layer


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_packed_equals_each_document_alone(chunk):
    """A row packing three documents gives each what it gives alone: the conv window and
    the state reset at every document start (starts inside and on chunk edges)."""
    layer = _layer(mamba_chunk_size=chunk)
    bounds = [0, 5, 8, 17]
    x = torch.randn(17, 1, 21)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 3, 9]))[None]
    packed = layer(x, None, None, Documents(doc_ids, None, None))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        torch.testing.assert_close(packed[lo:hi], layer(x[lo:hi], None, None), rtol=1e-5, atol=1e-6)


def test_chunk_size_does_not_change_the_result():
    x = torch.randn(19, 2, 21)
    want = _layer(mamba_chunk_size=19)(x, None, None)
    for chunk in (1, 4, 7):
        torch.testing.assert_close(_layer(mamba_chunk_size=chunk)(x, None, None), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, problem", [
    (dict(layer_types=["mamba2"] * 4, mamba_num_heads=5, mamba_num_groups=2),
     "model.mamba_num_heads=5 must be a multiple of model.mamba_num_groups=2"),
    (dict(layer_types=["mamba2"] * 4, mamba_state_size=0), "model.mamba_state_size=0"),
    (dict(layer_types=["mamba2"] * 4, mamba_dt_min=0.2), "must satisfy 0 < mamba_dt_min <= mamba_dt_max"),
    (dict(layer_types=["mamba2", "mlp", "attention", "moe"]),
     "model.layer_types[1]='mlp' is a layer with a channel mixer alone: it needs model.block=single_mixer"),
    (dict(block="single_mixer"), "model.block=single_mixer needs model.layer_types"),
    (dict(block="single_mixer", layer_types=["mamba2", "moe", "attention", "mlp"], mtp_num_layers=1),
     "model.mtp_num_layers=1 with model.block=single_mixer"),
    (dict(block="single_mixer", layer_types=["mamba2", "moe", "attention", "mlp"], **{"moe.first_k_dense": 1}),
     "moe.first_k_dense=1 with model.block=single_mixer: the MoE layers are the model.layer_types entries"),
])
def test_mamba2_rules(overrides, problem):
    config = Config()
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        setattr(getattr(config, section or "model"), name, value)
    with pytest.raises(ConfigError) as err:
        validate(config, 1)
    assert problem in str(err.value)


def test_mamba2_groups_over_tp_and_cp_conv_window():
    config = Config()
    config.model.layer_types, config.model.mamba_num_groups = ["mamba2"] * 4, 3
    config.parallel.tp = 2
    with pytest.raises(ConfigError, match=r"model.mamba_num_groups=3 .*parallel.tp=2"):
        validate(config, 2)
    config = Config()
    config.model.layer_types, config.model.seq_length, config.parallel.cp = ["mamba2"] * 4, 8, 4
    with pytest.raises(ConfigError, match="gives 1 tokens each; Mamba2's conv window needs at least"):
        validate(config, 4)
