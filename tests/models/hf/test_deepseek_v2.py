"""DeepSeek-V2 / V2-Lite Hugging Face interop: tiny random ``DeepseekV2ForCausalLM``
models of odd sizes, built with transformers' own classes and saved with save_pretrained,
import with transformers' logits (V2-Lite's shape: full-rank query, greedy top-k, no
scaling; V2's: low-rank query, ``group_limited_greedy`` ranking a group by its best
score, ``routed_scaling_factor``, YaRN) on one process and under tp2 x ep2 and pp2 x cp2
on gloo ranks; export (from one process and from both layouts) writes back the very same
safetensors tensors; what the importer or the exporter cannot represent is refused by name."""

import json

import pytest
import torch
import transformers

from moe_fold.config import load_config
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf
from tests.helpers.hf_family_checks import check_import_and_round_trip, check_layouts
from tests.models.hf.test_deepseek_v3 import randomize, token_ids

VOCAB = 70

# Odd sizes: 6 heads, hidden 42, kv rank 10, qk 6+4, v 5; 8 experts of 22.
COMMON = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=6, n_routed_experts=8, num_experts_per_tok=3,
              first_k_dense_replace=1, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
              max_position_embeddings=64)

CASES = {
    # DeepSeek-V2-Lite's shape: full-rank query, greedy top-k over all experts, two shared experts.
    "lite": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2,
                 routed_scaling_factor=1.0, rope_parameters=dict(rope_type="default", rope_theta=5e4)),
    # DeepSeek-V2's: low-rank query, the 2 of 4 groups with the highest single score, scaled
    # probabilities, YaRN with V2's mscale 0.707.
    "v2": dict(q_lora_rank=14, topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5,
               rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                                    beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
}


def hf_model(case: str, seed: int = 0):
    config = transformers.DeepseekV2Config(**{**COMMON, **CASES[case]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    return randomize(model, seed)


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    check_import_and_round_trip(hf_model(case), "deepseek_v2", tmp_path, case)


def test_config_mapping():
    v2 = config_from_hf(hf_model("v2").config.to_dict())
    m, moe = v2.model, v2.moe
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.rope_interleave, m.rope_scaling) == ("mla", 14, 10, True,
                                                                                             "yarn")
    assert (m.yarn_mscale, m.yarn_mscale_all_dim, m.mtp_num_layers) == (0.707, 0.707, 0)
    assert (moe.score_function, moe.pre_softmax, moe.expert_bias) == ("softmax", True, False)
    assert (moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor) == (4, 2, "max", 2.5)
    assert (moe.first_k_dense, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == (1, 22, False)
    lite = config_from_hf(hf_model("lite").config.to_dict())
    assert (lite.model.q_lora_rank, lite.model.rope_scaling, lite.model.rope_theta) == (None, None, 5e4)
    assert (lite.moe.num_groups, lite.moe.scaling_factor, lite.moe.shared_expert_ffn_hidden_size) == (None, None, 44)


# The config.json of DeepSeek-V2-Lite as the Hub holds it (4.x keys, remote code).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}


def test_released_v2_lite_config_imports_to_our_preset():
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("deepseek-v2-lite")
    imported = config_from_hf(DEEPSEEK_V2_LITE, ours)
    assert _architecture_mismatch(ours, imported) == []
    assert imported.moe.seq_aux_loss_coeff == 0.001 and imported.moe.aux_loss_coeff == 0.0


def _refused(tmp_path, edit, case="v2"):
    hf_model(case).save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(HFConfigError) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit,named", [
    (lambda hf: hf.update(norm_topk_prob=True), "norm_topk_prob=True is not supported: transformers' DeepseekV2 "
                                                "ignores it"),
    (lambda hf: hf.update(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    (lambda hf: hf.update(topk_group=1), "num_experts_per_tok=3 with topk_group=1"),
    (lambda hf: hf.update(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (lambda hf: hf.update(attention_bias=True), "attention_bias=True"),
    (lambda hf: hf.update(mlp_bias=True), "mlp_bias=True"),
    (lambda hf: hf.update(rope_interleave=False), "rope_interleave=False"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_export_takes_only_what_deepseek_v2_ranks_alike(tmp_path):
    """transformers ranks a group by its best score: Megatron-Core's topk_sum exports when
    topk = group_topk (the same ranking); a renormalised top-k, an expert bias or another
    family's name is refused by name, before anything is written."""
    hf_model("v2").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    ids = token_ids()
    want = model.logits(ids)
    moe = model.config.moe
    moe.group_score = "top2_sum"
    assert not torch.equal(model.logits(ids), want)  # the router reads the config: top2_sum routes otherwise
    with pytest.raises(HFConfigError, match=r"moe.group_score=top2_sum with moe.topk=3 and moe.group_topk=2: "
                                            r"DeepSeek-V2 ranks a group by its best score, this model by the sum "
                                            r"of its best 2"):
        to_hf(model, tmp_path / "out")
    moe.group_score = "max"
    moe.pre_softmax = False
    with pytest.raises(HFConfigError, match="moe.pre_softmax=false: DeepSeek-V2 keeps the top-k"):
        to_hf(model, tmp_path / "out")
    moe.pre_softmax = True
    with pytest.raises(HFConfigError, match="moe.score_function=softmax: DeepSeek-V3 and GLM-4.5 route with sigmoid"):
        to_hf(model, tmp_path / "out", family="deepseek_v3")
    assert not (tmp_path / "out").exists()
    # topk_sum with topk = group_topk ranks by the best score too: exported, same logits back.
    moe.topk, moe.group_score = 2, "topk_sum"
    two = model.logits(ids)
    moe.group_score = "max"
    assert torch.equal(model.logits(ids), two)
    moe.group_score = "topk_sum"
    to_hf(model, tmp_path / "megatron")
    assert torch.equal(from_hf(tmp_path / "megatron").eval().logits(ids), two)


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({case: hf_model(case) for case in CASES}, "deepseek_v2", sizes, tmp_path)