"""gpt-oss Hugging Face interop: tiny random ``GptOssForCausalLM`` models of odd sizes,
built with transformers' own classes and saved with save_pretrained (the bf16/fp32 layout
of its random init), import with transformers' logits on one process and under tp2 x ep2
(etp2: fc2's bias split over etp) and pp2 x cp2 on gloo ranks; export writes back the very
same safetensors tensors; an MXFP4-quantized config and what else the importer cannot
represent are refused by name.

What the model exercises: q, k, v and o biases, attention sinks, a sliding window of 5
keys on the sliding_attention layers (shorter than the 12-token sequence), YaRN rotary not
truncated; a router with bias (softmax over the top-k logits), experts with biases and the
clamped SwiGLU on gate and up columns that gpt-oss interleaves."""

import json

import pytest
import torch
import transformers

from moe_fold.config import ConfigError
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf
from tests.helpers.hf_family_checks import check_import_and_round_trip, check_layouts
from tests.models.hf.test_deepseek_v3 import VOCAB, hf_logits, max_diff, randomize, token_ids

TOL = 1e-5
# Odd sizes: vocab 70, hidden 42, 6 heads of 8 over 2 kv heads (q width 48 != hidden), 6 experts
# of width 22, top-3, 4 layers alternating sliding/full; a swiglu_limit that clamps here.
GPT_OSS = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=22, num_hidden_layers=4, num_attention_heads=6,
               num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=3, sliding_window=5,
               max_position_embeddings=64, swiglu_limit=1.3, swiglu_alpha=1.702,
               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                    original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False))


def hf_model(seed: int = 0, **overrides):
    """A tiny transformers gpt-oss with weights large enough that routing, the clamps and
    every layer matter (matrices N(0, 0.2), vectors U(0.5, 1.5): biases, sinks, norms)."""
    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    return randomize(model, seed)


def test_import_matches_transformers_and_export_round_trips(tmp_path):
    check_import_and_round_trip(hf_model(), "gpt_oss", tmp_path, label="gpt_oss", attn_implementation="eager")


def test_every_feature_changes_the_logits(tmp_path):
    """The sliding window, the sinks, the clamp and the biases each move transformers'
    logits here, so a match above is not a match of a model without them."""
    ids = token_ids()
    ref = hf_logits(hf_model(), ids)
    for overrides in (dict(sliding_window=64), dict(swiglu_limit=100.0)):
        assert max_diff(hf_logits(hf_model(**overrides), ids), ref) > 1e-3, overrides
    for name in ("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias", "o_proj.bias"):
        model = hf_model()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(name):
                    p.zero_()
        assert max_diff(hf_logits(model, ids), ref) > 1e-3, name


def test_config_mapping():
    config = config_from_hf(hf_model().config.to_dict())
    m, moe = config.model, config.moe
    assert (m.qkv_bias, m.attention_out_bias, m.attention_sinks, m.sliding_window) == (True, True, True, 5)
    assert m.local_attention_layers == [1, 0, 1, 0]
    assert (m.rope_scaling, m.yarn_factor, m.yarn_truncate, m.rope_theta) == ("yarn", 32.0, False, 150000.0)
    assert (moe.router_bias, moe.expert_linear_bias, moe.activation, moe.swiglu_limit) == (
        True, True, "clamped_swiglu", 1.3)
    assert (moe.score_function, moe.pre_softmax, moe.num_experts, moe.topk, moe.ffn_hidden_size) == (
        "softmax", False, 6, 3, 22)
    # Every layer sliding: no per-layer list; no window at all: none.
    every = config_from_hf(hf_model(layer_types=["sliding_attention"] * 4).config.to_dict()).model
    assert (every.sliding_window, every.local_attention_layers) == (5, None)
    full = config_from_hf(hf_model(layer_types=["full_attention"] * 4).config.to_dict()).model
    assert (full.sliding_window, full.local_attention_layers) == (0, None)


def _refused(tmp_path, edit):
    hf_model().save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises((HFConfigError, ConfigError)) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit, named", [
    (lambda hf: hf.update(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}),
     "quantization_config (quant_method='mxfp4') is not supported"),
    (lambda hf: hf.update(layer_types=["sliding_attention", "chunked_attention", "full_attention", "full_attention"]),
     "layer_types has ['chunked_attention']"),
    (lambda hf: hf.update(attention_dropout=0.1), "attention_dropout=0.1"),
    (lambda hf: hf.update(swiglu_limit=-1.0), "moe.swiglu_limit=-1.0 must be > 0"),
], ids=["mxfp4", "layer_types", "dropout", "limit"])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_export_refuses_what_the_family_cannot_hold(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="mixtral")
    for field in ("moe.router_bias=true", "moe.expert_linear_bias=true", "moe.activation=clamped_swiglu",
                  "model.attention_out_bias=true", "model.attention_sinks=True", "model.local_attention_layers=[1, 0, 1, 0]",
                  "model.rope_scaling=yarn"):
        assert field in str(err.value), field
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({"gpt_oss": hf_model()}, "gpt_oss", sizes, tmp_path)
