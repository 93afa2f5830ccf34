"""GLM-4.5-MoE and OLMoE Hugging Face interop: tiny random ``Glm4MoeForCausalLM`` and
``OlmoeForCausalLM`` models of odd sizes, built with transformers' own classes and saved
with save_pretrained, import with transformers' logits on one process and under
tp2 x ep2 and pp2 x cp2 on gloo ranks; export writes back the very same safetensors
tensors; what the importer cannot represent is refused by name.

GLM-4.5: partial rotary (the first half of each head), q|k|v biases, per-head QK-norm,
sigmoid routing with the score correction bias over groups, scaled; an ungated shared
expert; the first layer dense. OLMoE: a QK-norm over the whole q and k projections (split
over tp, its sum of squares reduced there), softmax top-k without renormalisation."""

import json

import pytest
import torch
import transformers

from moe_fold.config import ConfigError
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf
from tests.helpers.hf_family_checks import check_import_and_round_trip, check_layouts
from tests.models.hf.test_deepseek_v3 import VOCAB, randomize

# Odd sizes: vocab 70, 6 heads of 8 over 2 kv heads (hidden 48), ffn 50, experts of 22.
GLM = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
           num_attention_heads=6, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
           num_experts_per_tok=4, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
           attention_bias=True, use_qk_norm=True, max_position_embeddings=64, num_mtp_layers=0,
           rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
OLMOE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=22, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, max_position_embeddings=64,
             rope_parameters=dict(rope_type="default", rope_theta=5e4))

CASES = {
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, GLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, OLMOE),
}


def hf_model(case: str, seed: int = 0, **overrides):
    """A tiny transformers model with weights large enough that routing and every layer
    matter (matrices N(0, 0.2), vectors U(0.5, 1.5), score correction bias N(0, 0.1))."""
    config_cls, model_cls, kwargs = CASES[case]
    config = config_cls(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    return randomize(model, seed)


# (case, config overrides): GLM-4.5 also with num_experts_per_tok 3 != 2 x topk_group, where a
# group still ranks by its best 2 scores.
@pytest.mark.parametrize("case, overrides", [("glm4_moe", {}), ("glm4_moe", dict(num_experts_per_tok=3)),
                                             ("olmoe", {})], ids=["glm4_moe", "glm4_moe_k3", "olmoe"])
def test_import_matches_transformers_and_export_round_trips(case, overrides, tmp_path):
    check_import_and_round_trip(hf_model(case, **overrides), case, tmp_path, label=case)


def test_config_mapping():
    glm = config_from_hf(hf_model("glm4_moe").config.to_dict())
    m, moe = glm.model, glm.moe
    assert (m.partial_rotary_factor, m.qkv_bias, m.qk_norm, m.qk_norm_scope, m.head_dim) == (0.5, True, True, "head", 8)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.topk) == ("sigmoid", True, 4, 2, 4)
    assert (moe.first_k_dense, moe.scaling_factor, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == (
        1, 2.5, 22, False)
    assert moe.group_score == "top2_sum"
    olmoe = config_from_hf(hf_model("olmoe").config.to_dict())
    m, moe = olmoe.model, olmoe.moe
    assert (m.qk_norm, m.qk_norm_scope, m.partial_rotary_factor, m.rope_theta) == (True, "projection", 1.0, 5e4)
    assert (moe.pre_softmax, moe.score_function, moe.num_experts, moe.topk, moe.ffn_hidden_size) == (
        True, "softmax", 8, 3, 22)


def _refused(tmp_path, case, edit):
    hf_model(case).save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    # HFConfigError for a key we cannot map, ConfigError for a mapped value our rules refuse.
    with pytest.raises((HFConfigError, ConfigError)) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("case, edit, named", [
    ("glm4_moe", lambda hf: hf.update(norm_topk_prob=False), "norm_topk_prob=False"),
    ("glm4_moe", lambda hf: hf.update(topk_group=1), "topk_group=1"),
    ("glm4_moe", lambda hf: hf["rope_parameters"].update(partial_rotary_factor=0.3),
     "model.partial_rotary_factor=0.3 of head_dim=8 gives 2.4 rotary dims"),
    ("olmoe", lambda hf: hf.update(clip_qkv=8.0), "clip_qkv=8.0"),
    ("olmoe", lambda hf: hf.update(attention_bias=True), "attention_bias=True"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, case, edit, named):
    assert named in _refused(tmp_path, case, edit)


def test_export_refuses_what_the_family_cannot_hold(tmp_path):
    hf_model("olmoe").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="model.qk_norm_scope=projection: qwen3_moe normalises each head"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    hf_model("glm4_moe").save_pretrained(tmp_path / "glm")
    model = from_hf(tmp_path / "glm")
    with pytest.raises(HFConfigError, match="model.partial_rotary_factor=0.5: mixtral rotates the whole head"):
        to_hf(model, tmp_path / "out", family="mixtral")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({case: hf_model(case) for case in CASES}, "glm4_moe/olmoe", sizes, tmp_path)
