"""ERNIE-4.5-MoE Hugging Face interop: tiny random ``Ernie4_5_MoeForCausalLM`` models of
odd sizes, built with transformers' own classes and saved with save_pretrained, import
with transformers' logits on one process and under tp2 x ep2 and pp2 x cp2 on gloo ranks;
export (from one process and from both layouts) writes back the very same safetensors
tensors; what the importer or the exporter cannot represent is refused by name.

ERNIE-4.5: grouped-query attention with interleaved rotary pairs; MoE on the layers from
``moe_layer_start_index`` to ``moe_layer_end_index`` every ``moe_layer_interval``; softmax
over all experts with the expert bias (``moe_statics.e_score_correction_bias [1, E]``)
added for selection only, the chosen probabilities divided by max(their sum,
``moe_norm_min``); ungated shared experts; tied embeddings by default."""

import json

import pytest
import torch
import transformers

from moe_fold.config import load_config
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf
from tests.helpers.hf_family_checks import check_import_and_round_trip, check_layouts
from tests.models.hf.test_deepseek_v3 import VOCAB, randomize


# Odd sizes: vocab 70, 6 heads of 8 over 2 kv heads (hidden 48), dense width 50, experts of 22.
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=50, moe_intermediate_size=22,
              num_attention_heads=6, num_key_value_heads=2, moe_num_experts=8, moe_k=3, max_position_embeddings=64)

CASES = {
    # ERNIE-4.5-21B-A3B's pattern: layer 0 dense, every later layer MoE, 2 shared experts,
    # tied embeddings, the default moe_norm_min 1e-12.
    "a3b": dict(num_hidden_layers=4, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1,
                moe_num_shared_experts=2, tie_word_embeddings=True, rope_parameters=dict(rope_type="default",
                                                                                         rope_theta=5e5)),
    # Every second layer from 1 to 4 of 6 (layers 1 and 3: 5 is past the end), no shared expert, untied, heads
    # of 10 (wider than hidden/heads), a renormalisation floor 0.6 that the top-3 sums often undercut.
    "interval": dict(num_hidden_layers=6, moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2,
                     moe_num_shared_experts=0, tie_word_embeddings=False, head_dim=10, moe_norm_min=0.6,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4)),
}


def hf_model(case: str, seed: int = 0):
    """A tiny transformers ERNIE-4.5-MoE with weights large enough that routing and every
    layer matter, and an expert bias N(0, 0.1) that changes which experts are chosen."""
    config = transformers.Ernie4_5_MoeConfig(**{**COMMON, **CASES[case]})
    torch.manual_seed(seed)
    model = transformers.Ernie4_5_MoeForCausalLM(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    model = check_import_and_round_trip(hf_model(case), "ernie4_5_moe", tmp_path, case)
    assert model.layers[1].mlp.router.expert_bias.abs().sum() > 0


def test_config_mapping():
    a3b = config_from_hf(hf_model("a3b").config.to_dict())
    m, moe = a3b.model, a3b.moe
    assert (m.rope_interleave, m.tie_embeddings, m.head_dim, m.num_kv_heads, m.rope_theta) == (True, True, 8, 2, 5e5)
    assert (moe.score_function, moe.pre_softmax, moe.expert_bias, moe.topk_norm_min) == ("softmax", True, True, 1e-12)
    assert (moe.moe_layer_freq, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == ([0, 1, 1, 1], 44,
                                                                                               False)
    interval = config_from_hf(hf_model("interval").config.to_dict())
    assert interval.moe.moe_layer_freq == [0, 1, 0, 1, 0, 0]
    assert (interval.moe.topk_norm_min, interval.moe.shared_expert_ffn_hidden_size, interval.model.head_dim) == (
        0.6, 0, 10)


def test_transformers_default_config_is_our_preset():
    """transformers' Ernie4_5_MoeConfig defaults are ERNIE-4.5-21B-A3B's (its documented
    checkpoint): they import to the ernie-4.5-21b-a3b preset's architecture."""
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("ernie-4.5-21b-a3b")
    imported = config_from_hf(transformers.Ernie4_5_MoeConfig().to_dict(), ours)
    assert _architecture_mismatch(ours, imported) == []


def _refused(tmp_path, edit, case="a3b"):
    hf_model(case).save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(HFConfigError) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit,named", [
    (lambda hf: hf.update(use_bias=True), "use_bias=True is not supported: ERNIE-4.5's use_bias puts biases on "
                                          "every linear"),
    (lambda hf: hf.update(moe_layer_interval=0), "moe_layer_interval=0 must be an integer >= 1"),
    (lambda hf: hf["rope_parameters"].update(rope_type="linear", factor=2.0), "rope_type='linear'"),
    (lambda hf: hf.update(hidden_act="gelu"), "hidden_act='gelu'"),
    (lambda hf: hf.update(moe_capacity=[64, 64, 64]), "moe_capacity: not understood"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_export_refuses_what_ernie_cannot_hold(tmp_path):
    hf_model("a3b").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    moe = model.config.moe
    with pytest.raises(HFConfigError, match="model.rope_interleave=true: qwen3_moe rotates two halves"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    with pytest.raises(HFConfigError, match="moe.topk_norm_min=1e-12: qwen2_moe has no renormalisation floor"):
        to_hf(model, tmp_path / "out", family="qwen2_moe")
    moe.moe_layer_freq = [1, 0, 1, 1]
    with pytest.raises(HFConfigError, match=r"moe layer pattern \[1, 0, 1, 1\]: ERNIE-4.5's MoE layers are every "
                                            r"moe_layer_interval-th layer"):
        to_hf(model, tmp_path / "out")
    moe.moe_layer_freq, moe.topk_norm_min = [0, 1, 1, 1], None
    with pytest.raises(HFConfigError, match="moe.topk_norm_min=null: ERNIE-4.5 always renormalises"):
        to_hf(model, tmp_path / "out", family="ernie4_5_moe")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({case: hf_model(case) for case in CASES}, "ernie4_5_moe", sizes, tmp_path)