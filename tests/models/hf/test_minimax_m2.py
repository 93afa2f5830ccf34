"""MiniMax-M2 Hugging Face interop: tiny random ``MiniMaxM2ForCausalLM`` models of odd
sizes, built with transformers' own classes and saved with save_pretrained, import with
transformers' logits on one process and under tp2 x ep2 and pp2 x cp2 on gloo ranks;
export (from one process and from both layouts) writes back the very same safetensors
tensors; what the importer or the exporter cannot represent is refused by name.

MiniMax-M2: grouped-query attention with an RMSNorm over the whole q and k projections
(split over tp, its sum of squares reduced there), rotary embeddings on the first
``rotary_dim`` dims of each head; every layer MoE with Mixtral's tensor names: sigmoid
scores, the expert bias (``block_sparse_moe.e_score_correction_bias``) added for selection
only, the top-k renormalised; no shared expert."""

import json

import pytest
import torch
import transformers

from moe_fold.config import load_config
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf
from tests.helpers.hf_family_checks import check_import_and_round_trip, check_layouts
from tests.models.hf.test_deepseek_v3 import VOCAB, randomize


# Odd sizes: vocab 70, hidden 48, 6 heads over 2 kv heads, experts of 22.
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=22, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, num_local_experts=8, max_position_embeddings=64, bos_token_id=1,
              eos_token_id=2)

CASES = {
    # MiniMax-M2's shape: heads wider than hidden/heads (10), rotary on the first 6 dims
    # of each (MiniMax-M2 rotates 64 of 128), top-3, untied.
    "m2": dict(head_dim=10, rotary_dim=6, num_experts_per_tok=3, rope_parameters=dict(rope_type="default",
                                                                                      rope_theta=5e6)),
    # Rotary on the whole head of 8, top-2, tied embeddings, router jitter (training only).
    "full_rotary": dict(head_dim=8, num_experts_per_tok=2, tie_word_embeddings=True, router_jitter_noise=0.05,
                        rope_parameters=dict(rope_type="default", rope_theta=1e4)),
}


def hf_model(case: str, seed: int = 0):
    """A tiny transformers MiniMax-M2 with weights large enough that routing and every
    layer matter, and an expert bias N(0, 0.1) that changes which experts are chosen."""
    config = transformers.MiniMaxM2Config(**{**COMMON, **CASES[case]})
    torch.manual_seed(seed)
    model = transformers.MiniMaxM2ForCausalLM(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    model = check_import_and_round_trip(hf_model(case), "minimax_m2", tmp_path, case)
    assert model.layers[0].mlp.router.expert_bias.abs().sum() > 0


def test_config_mapping():
    m2 = config_from_hf(hf_model("m2").config.to_dict())
    m, moe = m2.model, m2.moe
    assert (m.head_dim, m.partial_rotary_factor, m.qk_norm, m.qk_norm_scope, m.rope_theta) == (10, 0.6, True,
                                                                                              "projection", 5e6)
    assert (moe.score_function, moe.expert_bias, moe.pre_softmax, moe.topk, moe.ffn_hidden_size) == (
        "sigmoid", True, False, 3, 22)
    assert (moe.num_groups, moe.scaling_factor, moe.shared_expert_ffn_hidden_size, moe.moe_layer_freq) == (
        None, None, 0, 1)
    full = config_from_hf(hf_model("full_rotary").config.to_dict())
    assert (full.model.partial_rotary_factor, full.model.tie_embeddings, full.moe.input_jitter) == (1.0, True, 0.05)


def test_transformers_default_config_is_our_preset():
    """transformers' MiniMaxM2Config defaults are MiniMax-M2's (its documented checkpoint)
    but for the rotary width, which the released config.json sets (rotary_dim 64): with it
    they import to the minimax-m2 preset's architecture."""
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("minimax-m2")
    imported = config_from_hf(transformers.MiniMaxM2Config(rotary_dim=64).to_dict(), ours)
    assert _architecture_mismatch(ours, imported) == []


def _refused(tmp_path, edit, case="m2"):
    hf_model(case).save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(HFConfigError) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit,named", [
    (lambda hf: hf.update(num_experts_per_tok=1), "num_experts_per_tok=1 is not supported"),
    (lambda hf: hf.update(qk_norm_type="per_head"), "qk_norm_type='per_head'"),
    (lambda hf: hf.update(scoring_func="softmax"), "scoring_func='softmax'"),
    (lambda hf: hf.update(rotary_dim=4), "rotary_dim=4 disagrees with rope_parameters.partial_rotary_factor=0.6"),
    (lambda hf: hf.update(sliding_window=16), "sliding_window: not understood"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_export_refuses_what_minimax_m2_cannot_hold(tmp_path):
    hf_model("m2").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    with pytest.raises(HFConfigError, match="model.partial_rotary_factor=0.6: olmoe rotates the whole head"):
        to_hf(model, tmp_path / "out", family="olmoe")
    model.config.moe.moe_layer_freq = [0, 1, 1, 1]
    with pytest.raises(HFConfigError, match=r"moe layer pattern \[0, 1, 1, 1\]: every MiniMax-M2 layer is MoE"):
        to_hf(model, tmp_path / "out", family="minimax_m2")
    model.config.moe.moe_layer_freq, model.config.model.qk_norm_scope = 1, "head"
    with pytest.raises(HFConfigError, match="model.qk_norm_scope=head: MiniMax-M2 normalises the whole q and k"):
        to_hf(model, tmp_path / "out", family="minimax_m2")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({case: hf_model(case) for case in CASES}, "minimax_m2", sizes, tmp_path)