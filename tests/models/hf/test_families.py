"""Every Hugging Face family of the registry (``moe_fold.models.hf.families``), tested alike:
tiny random models of odd sizes, built with transformers' own classes and saved with
save_pretrained, import with transformers' logits on one process and under tp2 x ep2 and
pp2 x cp2 on gloo ranks; export (from one process and from both layouts) writes back the
very same safetensors tensors, which transformers loads again; what the importer cannot
represent is refused by name. Then each family's own checks: its config mapping, its
released config against our preset, what its exporter refuses.

A family's parameters: its :class:`~hf_family_checks.Spec` in ``SPECS`` (every case is
checked on one process and under both layouts) and its rows in ``REFUSED``.

- Mixtral, Qwen2-MoE, Qwen3-MoE: test_hf's cases at odd sizes (4 layers).
- DeepSeek-V2 / V2-Lite: V2-Lite's shape (full-rank query, greedy top-k, no scaling) and
  V2's (low-rank query, ``group_limited_greedy`` ranking a group by its best score,
  ``routed_scaling_factor``, YaRN).
- DeepSeek-V3: q_lora_rank set and unset, interleaved and plain rotary pairs, default and
  YaRN rotary, groups with k != 2 x topk_group.
- GLM-4.5: partial rotary (the first half of each head), q|k|v biases, per-head QK-norm,
  sigmoid routing with the score correction bias over groups, scaled; an ungated shared
  expert; the first layer dense. OLMoE: a QK-norm over the whole q and k projections (split
  over tp, its sum of squares reduced there), softmax top-k without renormalisation.
- ERNIE-4.5: interleaved rotary pairs; MoE on the layers from ``moe_layer_start_index`` to
  ``moe_layer_end_index`` every ``moe_layer_interval``; the expert bias
  (``moe_statics.e_score_correction_bias [1, E]``) added for selection only, the chosen
  probabilities divided by max(their sum, ``moe_norm_min``); ungated shared experts.
- MiniMax-M2: an RMSNorm over the whole q and k projections, rotary on the first
  ``rotary_dim`` dims of each head; Mixtral's tensor names, sigmoid scores with the expert
  bias, the top-k renormalised.
- Llama-4 text: top-1 sigmoid routing whose prob scales the expert's input, an ungated
  shared expert, MoE on every other layer, chunked attention (chunks of 5 in sequences of
  12) on the rotary layers, a NoPE layer with temperature tuning (``floor_scale`` 4), the
  L2 QK-norm, interleaved rotary pairs.
- gpt-oss: q, k, v and o biases, attention sinks, a sliding window of 5 keys on the
  sliding_attention layers, YaRN not truncated; a router with bias, experts with biases and
  the clamped SwiGLU on interleaved gate and up columns; MXFP4 refused.
"""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_fold.config import ConfigError, load_config
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, HFWeightError, config_from_hf
from moe_fold.models.hf.families import REGISTRY
from tests.helpers.hf_family_checks import (VOCAB, Spec, check_import_and_round_trip, check_layouts, hf_model, max_diff, refused,
                              tensors, token_ids)
from tests.models.hf.test_importer import hf_logits

# Odd sizes: vocab 70, 6 heads of 8 over 2 kv heads (hidden 48), dense width 50.
_ODD = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=50,
            num_hidden_layers=4, num_experts_per_tok=2, max_position_embeddings=64)
_QWEN = dict(_ODD, num_experts=4, moe_intermediate_size=22)

# DeepSeek-V2/V3: 6 heads, hidden 42, q/kv ranks 14/10, qk 6+4, v 5; 8 experts of 22.
_MLA = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=6, n_routed_experts=8, first_k_dense_replace=1,
            kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64)
DEEPSEEK_V3 = dict(_MLA, n_group=4, topk_group=2, num_experts_per_tok=4, num_nextn_predict_layers=0,
                   routed_scaling_factor=2.5)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)

# DSA (DeepSeek-V3.2, GLM-5): DeepSeek-V3's shape with a query latent, an indexer of 8 heads of 8, top 5 of 12.
# 8 heads: a key scores exactly 0 (every head negative) once in 256, so keys rarely tie at a
# query's k-th score, where transformers' topk orders ties arbitrarily (ours: the earlier key).
DSA = dict(DEEPSEEK_V3, q_lora_rank=14, index_n_heads=8, index_head_dim=8, index_topk=5)

GLM = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
           num_attention_heads=6, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
           num_experts_per_tok=4, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
           attention_bias=True, use_qk_norm=True, max_position_embeddings=64, num_mtp_layers=0,
           rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))

_HYBRID = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
               num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=22,
               shared_expert_intermediate_size=30, linear_num_key_heads=2, linear_num_value_heads=6,
               linear_key_head_dim=6, linear_value_head_dim=5, linear_conv_kernel_dim=4, max_position_embeddings=64)

KIMI = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=6, num_experts=8, num_experts_per_tok=3, num_shared_experts=1,
            routed_scaling_factor=2.5, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            linear_num_heads=4, linear_head_dim=5, linear_conv_kernel_dim=4, max_position_embeddings=64,
            pad_token_id=None, bos_token_id=1, eos_token_id=2)

# LongCat-Flash: 2 blocks (4 attention sublayers), 6 MLA heads, hidden 42, q/kv ranks 14/10, qk
# 6+4, v 5, dense width 50; 6 experts of 22 and 3 zero experts, top-4 of the 9. Matrices
# N(0, 0.15): at 0.2 transformers' float32 logits stray 1.4e-5 from its own float64 forward.
_LONGCAT = dict(vocab_size=VOCAB, hidden_size=42, num_layers=2, num_attention_heads=6, ffn_hidden_size=50,
                q_lora_rank=14, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, head_dim=4, v_head_dim=5,
                n_routed_experts=6, zero_expert_num=3, moe_topk=4, expert_ffn_hidden_size=22,
                max_position_embeddings=64)

_NEMOTRON_H = dict(vocab_size=VOCAB, hidden_size=42, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                   intermediate_size=50, mamba_num_heads=6, mamba_head_dim=5, ssm_state_size=7, n_groups=2,
                   conv_kernel=4, chunk_size=8, n_routed_experts=6, moe_intermediate_size=22,
                   moe_shared_expert_intermediate_size=30, max_position_embeddings=64)

SPECS = {
    "mixtral": Spec("MixtralConfig", "MixtralForCausalLM", dict(_ODD, num_local_experts=4),
                    {"mixtral_gqa": dict(rope_theta=5e5)}),
    "qwen2_moe": Spec("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_QWEN, shared_expert_intermediate_size=30), {
        # Gated shared expert, layer 1 dense (mlp_only_layers), top-k of the full softmax.
        "qwen2_shared_dense": dict(mlp_only_layers=[1], norm_topk_prob=False),
        # Layers 0 and 2 dense (decoder_sparse_step=2), renormalised top-k.
        "qwen2_sparse_step_norm": dict(decoder_sparse_step=2, norm_topk_prob=True)}),
    "qwen3_moe": Spec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN, {
        "qwen3_norm_topk": dict(head_dim=16, norm_topk_prob=True),
        "qwen3_no_norm_tied": dict(norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[0],
                                   rms_norm_eps=1e-5)}),
    "deepseek_v2": Spec("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MLA, num_experts_per_tok=3), {
        # DeepSeek-V2-Lite's shape: full-rank query, greedy top-k over all experts, two shared
        # experts; rms_norm_eps 1e-5, while transformers' latent norms keep 1e-6.
        "lite": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2, rms_norm_eps=1e-5,
                     routed_scaling_factor=1.0, rope_parameters=dict(rope_type="default", rope_theta=5e4)),
        # DeepSeek-V2's: low-rank query, the 2 of 4 groups with the highest single score, scaled
        # probabilities, YaRN with V2's mscale 0.707.
        "v2": dict(q_lora_rank=14, topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=1,
                   routed_scaling_factor=2.5,
                   rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                        original_max_position_embeddings=16, beta_fast=32, beta_slow=1, mscale=0.707,
                                        mscale_all_dim=0.707))}),
    "deepseek_v3": Spec("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3, {
        # Low-rank query, interleaved rotary pairs, YaRN with a softmax mscale.
        "q_lora_yarn": dict(q_lora_rank=14, rope_interleave=True, rope_parameters=YARN),
        # Full-rank query, plain rotary halves, no rotary scaling, two shared experts, no groups;
        # rms_norm_eps 1e-5, while transformers' latent norms keep 1e-6.
        "no_q_lora": dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2, n_group=1, topk_group=1,
                          num_experts_per_tok=3, routed_scaling_factor=1.7, rms_norm_eps=1e-5,
                          rope_parameters=dict(rope_type="default", rope_theta=5e4)),
        # num_experts_per_tok 3 != 2 x topk_group: a group still ranks by its best 2 scores.
        "groups_k3": dict(q_lora_rank=14, rope_interleave=False, num_experts_per_tok=3,
                          rope_parameters=dict(rope_type="default", rope_theta=1e4))}),
    # GLM-4.5 also with num_experts_per_tok 3 != 2 x topk_group, where a group still ranks by its best 2 scores.
    "glm4_moe": Spec("Glm4MoeConfig", "Glm4MoeForCausalLM", GLM, {"glm4_moe": {},
                                                                  "glm4_moe_k3": dict(num_experts_per_tok=3)}),
    "olmoe": Spec("OlmoeConfig", "OlmoeForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=22, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                       max_position_embeddings=64),
                  {"olmoe": dict(rope_parameters=dict(rope_type="default", rope_theta=5e4))}),
    "ernie4_5_moe": Spec("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                         dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=50, moe_intermediate_size=22,
                              num_attention_heads=6, num_key_value_heads=2, moe_num_experts=8, moe_k=3,
                              max_position_embeddings=64), {
        # ERNIE-4.5-21B-A3B's pattern: layer 0 dense, every later layer MoE, 2 shared experts,
        # tied embeddings, the default moe_norm_min 1e-12.
        "a3b": dict(num_hidden_layers=4, moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1,
                    moe_num_shared_experts=2, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="default", rope_theta=5e5)),
        # Every second layer from 1 to 4 of 6 (layers 1 and 3: 5 is past the end), no shared expert, untied,
        # heads of 10 (wider than hidden/heads), a renormalisation floor 0.6 that the top-3 sums often undercut.
        "interval": dict(num_hidden_layers=6, moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2,
                         moe_num_shared_experts=0, tie_word_embeddings=False, head_dim=10, moe_norm_min=0.6,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4))}),
    "minimax_m2": Spec("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                       dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=22, num_hidden_layers=4,
                            num_attention_heads=6, num_key_value_heads=2, num_local_experts=8,
                            max_position_embeddings=64, bos_token_id=1, eos_token_id=2), {
        # MiniMax-M2's shape: heads wider than hidden/heads (10), rotary on the first 6 dims
        # of each (MiniMax-M2 rotates 64 of 128), top-3, untied.
        "m2": dict(head_dim=10, rotary_dim=6, num_experts_per_tok=3,
                   rope_parameters=dict(rope_type="default", rope_theta=5e6)),
        # Rotary on the whole head of 8, top-2, tied embeddings, router jitter (training only).
        "full_rotary": dict(head_dim=8, num_experts_per_tok=2, tie_word_embeddings=True, router_jitter_noise=0.05,
                            rope_parameters=dict(rope_type="default", rope_theta=1e4))}),
    # Odd sizes: 6 heads of 8 over 2 kv heads (hidden 42), dense ffn 50, experts of 22.
    "llama4_text": Spec("Llama4TextConfig", "Llama4ForCausalLM",
                        dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=22, intermediate_size_mlp=50,
                             num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                             num_local_experts=6, num_experts_per_tok=1, interleave_moe_layer_step=2,
                             attention_chunk_size=5, no_rope_layer_interval=4, floor_scale=4, attn_scale=0.3,
                             max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
                        {"llama4": {},
                         # Every layer MoE, two NoPE layers, no QK-norm, no temperature tuning.
                         "llama4_all_moe": dict(interleave_moe_layer_step=1, no_rope_layers=[1, 0, 1, 0],
                                                use_qk_norm=False, attn_temperature_tuning=False)},
                        eager_experts=False),
    # Hidden 42, 6 heads of 8 over 2 kv heads (q width 48 != hidden), 6 experts of width 22, top-3,
    # 4 layers alternating sliding/full; a swiglu_limit that clamps here.
    "gpt_oss": Spec("GptOssConfig", "GptOssForCausalLM",
                    dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=22, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                         num_experts_per_tok=3, sliding_window=5, max_position_embeddings=64, swiglu_limit=1.3,
                         swiglu_alpha=1.702,
                         rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                              original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                              truncate=False)),
                    {"gpt_oss": {}}, eager_attention=True),
    # Qwen3-Next: 2 key heads of 6 over 6 value heads of 5 (3 per key head), conv of 4 taps; gated
    # attention of 6 heads of 8 over 2 kv heads, rotary on the first 2 dims (0.25); 4 experts of 22
    # and a gated shared expert of 30. Zero-centred norms; matrices N(0, 0.1): at 0.2 float32
    # itself strays 1.4e-4 (transformers) and 2.3e-4 (ours) from a float64 forward of this model.
    "qwen3_next": Spec("Qwen3NextConfig", "Qwen3NextForCausalLM", _HYBRID, {
        # Three Gated DeltaNet layers, then gated attention; layer 1 dense; renormalised top-k.
        "qwen3_next": dict(intermediate_size=50, mlp_only_layers=[1], norm_topk_prob=True),
        # Attention first and third, every layer MoE, top-k of the full softmax, tied, rotary on half.
        "qwen3_next_mixed": dict(layer_types=["full_attention", "linear_attention", "full_attention",
                                              "linear_attention"], norm_topk_prob=False, tie_word_embeddings=True,
                                 rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                      partial_rotary_factor=0.5))},
        matrix_std=0.1, zero_centred=True),
    # Qwen3.5's text model: Qwen3-Next's layers, every layer MoE, renormalised top-k; separate
    # q|k|v, z, b and a projections; exported when asked by name. 4 value heads (2 per key
    # head): with 6, transformers' float32 logits stray 5.9e-5 from a float64 forward (ours 1.7e-5).
    "qwen3_5_moe": Spec("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _HYBRID,
                        {"qwen3_5_moe": dict(linear_num_value_heads=4)},
                        matrix_std=0.1, zero_centred=True, exported_by_default=False),
    # Kimi-Linear: KDA of 4 heads of 5 (conv of 4 taps); MLA without rotary of 6 heads, kv rank 10, qk 6+4,
    # v 5 (hidden 42); 8 experts of 22 with the score correction bias, scaled, one shared expert. Matrices
    # N(0, 0.1): at 0.2 float32 itself strays 2.1e-5 (transformers and ours) from a float64 forward.
    "kimi_linear": Spec("KimiLinearConfig", "KimiLinearForCausalLM", KIMI, {
        # Three KDA layers, then MLA; full-rank query; the first layer dense; no groups.
        "kimi_linear": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], first_k_dense_replace=1),
        # MLA first and last, low-rank query, every layer MoE, 2 of 4 groups, top-4.
        "kimi_linear_groups": dict(layer_types=["full_attention", "linear_attention", "linear_attention",
                                                "full_attention"], q_lora_rank=14, first_k_dense_replace=0,
                                   num_expert_group=4, topk_group=2, num_experts_per_tok=4)},
        matrix_std=0.1),
    "longcat_flash": Spec("LongcatFlashConfig", "LongcatFlashForCausalLM", _LONGCAT, {
        # LongCat-Flash's shape: routed_scaling_factor 6, rms_norm_eps 1e-5 (the latents' 1e-6), rope theta 1e7.
        "longcat_flash": dict(routed_scaling_factor=6.0),
        # YaRN with a softmax mscale, tied embeddings, unscaled probs, top-2, rms_norm_eps 1e-6.
        "longcat_yarn_tied": dict(moe_topk=2, routed_scaling_factor=1.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  rope_parameters=YARN)}, matrix_std=0.15),
    # DeepSeek-V3.2: DeepSeek-V3's MLA (q latent 14, interleaved pairs) and MoE layers, an indexer of
    # 8 heads of 8 on every layer keeping 5 of the 12 tokens' keys (rotary on two halves of its first 4 dims).
    "deepseek_v32": Spec("DeepseekV32Config", "DeepseekV32ForCausalLM", DSA, {
        "deepseek_v32": dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
        # YaRN, no groups, two shared experts, the indexer keeping 7 keys.
        "deepseek_v32_yarn": dict(rope_parameters=YARN, n_group=1, topk_group=1, n_shared_experts=2, index_topk=7)}),
    # GLM-5: the same with the indexer's rotary on interleaved pairs; layers 1 and 3 reuse the
    # selection of layers 0 and 2 (indexer_types).
    "glm_moe_dsa": Spec("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", DSA, {
        "glm_moe_dsa_shared": dict(indexer_types=["full", "shared", "full", "shared"],
                                   rope_parameters=dict(rope_type="default", rope_theta=1e4)),
        "glm_moe_dsa_full": dict(rope_parameters=dict(rope_type="default", rope_theta=1e4), index_topk=3)}),
    # Nemotron-H: 6 Mamba2 heads of 5 in 2 groups (state 7, conv of 4, chunks of 8), attention of 6
    # heads of 8 over 2 kv heads without rotary, relu2 MLPs of 50, 6 relu2 experts of 22 and a
    # relu2 shared expert of 30, sigmoid routing with the score correction bias.
    "nemotron_h": Spec("NemotronHConfig", "NemotronHForCausalLM", _NEMOTRON_H, {
        # Every mixer: Mamba2, MoE, attention, MLP; top-3 without groups.
        "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                              "moe"], num_experts_per_tok=3),
        # Attention first, 3 groups of which 2 are picked, scaled probabilities.
        "nemotron_h_groups": dict(layers_block_type=["full_attention", "moe", "linear_attention", "moe"],
                                  n_group=3, topk_group=2, num_experts_per_tok=2, routed_scaling_factor=2.5),
        # Nemotron 3 Super's latent MoE: experts of 22 in a latent width of 17 (hidden 42), top-3.
        "nemotron_h_latent": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                                  moe_latent_size=17, num_experts_per_tok=3, routed_scaling_factor=1.7)}),
}


def model_of(family: str, case: str = None, seed: int = 0, **overrides):
    """The tiny transformers model of ``family``'s ``case`` (default: its first)."""
    spec = SPECS[family]
    return hf_model(spec, case or next(iter(spec.cases)), seed, **overrides)


CASES = [(family, case) for family, spec in SPECS.items() for case in spec.cases]


def test_every_registered_family_is_tested():
    assert list(SPECS) == list(REGISTRY)


# What each family's import must show besides the logits: the score correction bias read.
def _expert_bias_read(layer):
    return lambda model, case: model.layers[layer].mlp.router.expert_bias.abs().sum() > 0


def _mla_read(model, case):
    m = model.config.model
    want = ("mla", SPECS["deepseek_v3"].cases[case]["q_lora_rank"], 10, 5)
    return (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == want and _expert_bias_read(1)(model, case)


def _longcat_read(model, case):
    m, moe = model.config.model, model.config.moe
    return ((m.block, m.mla_lora_scale, m.mla_norm_eps, moe.zero_experts, moe.num_experts) == (
        "shortcut_moe", True, 1e-6, 3, 6) and _expert_bias_read(1)(model, case))


def _nemotron_read(model, case):
    """The expert bias read, and the latent MoE's width (and its projections) where the case has one."""
    latent = SPECS["nemotron_h"].cases[case].get("moe_latent_size")
    mlp = model.layers[1].mlp
    projections = None if mlp.latent_in is None else (mlp.latent_in.weight.shape[0], mlp.experts.fc1.shape[1])
    return (model.config.moe.latent_size == latent and projections == (None if latent is None else (latent, latent))
            and _expert_bias_read(1)(model, case))


IMPORTED = {"deepseek_v3": _mla_read, "ernie4_5_moe": _expert_bias_read(1), "minimax_m2": _expert_bias_read(0),
            "longcat_flash": _longcat_read, "nemotron_h": _nemotron_read}


@pytest.mark.parametrize("family, case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_import_matches_transformers_and_export_round_trips(family, case, tmp_path):
    spec = SPECS[family]
    model = check_import_and_round_trip(hf_model(spec, case), family, tmp_path, case, spec.exported_by_default,
                                        **spec.load_kwargs())
    if family in IMPORTED:
        assert IMPORTED[family](model, case)


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
@pytest.mark.parametrize("family", list(SPECS))
def test_import_under_layouts(tmp_path, family, sizes):
    # DeepSeek-V3's stores every tensor per expert or whole: a rank reads exactly its elements.
    check_layouts({case: model_of(family, case) for case in SPECS[family].cases}, family, sizes, tmp_path,
                  count_reads=family == "deepseek_v3")


BOTH = (HFConfigError, ConfigError)  # HFConfigError for a key we cannot map, ConfigError for a value our rules refuse

# (family, case, edit of config.json, what the error names, the errors allowed)
REFUSED = [
    ("deepseek_v2", "v2", lambda hf: hf.update(norm_topk_prob=True),
     "norm_topk_prob=True is not supported: transformers' DeepseekV2 ignores it", HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(topk_method="noaux_tc"), "topk_method='noaux_tc'", HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(topk_group=1), "num_experts_per_tok=3 with topk_group=1",
     HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(scoring_func="sigmoid"), "scoring_func='sigmoid'", HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(attention_bias=True), "attention_bias=True", HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(mlp_bias=True), "mlp_bias=True", HFConfigError),
    ("deepseek_v2", "v2", lambda hf: hf.update(rope_interleave=False), "rope_interleave=False", HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf.update(norm_topk_prob=False), "norm_topk_prob=False",
     HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf.update(topk_group=1), "topk_group=1", HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf.update(attention_bias=True), "attention_bias=True", HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf.update(num_key_value_heads=2),
     "num_key_value_heads=2 must equal num_attention_heads=6", HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf["rope_parameters"].update(rope_type="linear"), "rope_type='linear'",
     HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf["rope_parameters"].update(attention_factor=0.5),
     "attention_factor=0.5", HFConfigError),
    ("deepseek_v3", "q_lora_yarn", lambda hf: hf.update(scoring_func="softmax"), "scoring_func='softmax'",
     HFConfigError),
    ("glm4_moe", "glm4_moe", lambda hf: hf.update(norm_topk_prob=False), "norm_topk_prob=False", BOTH),
    ("glm4_moe", "glm4_moe", lambda hf: hf.update(topk_group=1), "topk_group=1", BOTH),
    ("glm4_moe", "glm4_moe", lambda hf: hf["rope_parameters"].update(partial_rotary_factor=0.3),
     "model.partial_rotary_factor=0.3 of head_dim=8 gives 2.4 rotary dims", BOTH),
    ("olmoe", "olmoe", lambda hf: hf.update(clip_qkv=8.0), "clip_qkv=8.0", BOTH),
    ("olmoe", "olmoe", lambda hf: hf.update(attention_bias=True), "attention_bias=True", BOTH),
    ("ernie4_5_moe", "a3b", lambda hf: hf.update(use_bias=True),
     "use_bias=True is not supported: ERNIE-4.5's use_bias puts biases on every linear", HFConfigError),
    ("ernie4_5_moe", "a3b", lambda hf: hf.update(moe_layer_interval=0), "moe_layer_interval=0 must be an integer >= 1",
     HFConfigError),
    ("ernie4_5_moe", "a3b", lambda hf: hf["rope_parameters"].update(rope_type="linear", factor=2.0),
     "rope_type='linear'", HFConfigError),
    ("ernie4_5_moe", "a3b", lambda hf: hf.update(hidden_act="gelu"), "hidden_act='gelu'", HFConfigError),
    ("ernie4_5_moe", "a3b", lambda hf: hf.update(moe_capacity=[64, 64, 64]), "moe_capacity: not understood",
     HFConfigError),
    ("minimax_m2", "m2", lambda hf: hf.update(num_experts_per_tok=1), "num_experts_per_tok=1 is not supported",
     HFConfigError),
    ("minimax_m2", "m2", lambda hf: hf.update(qk_norm_type="per_head"), "qk_norm_type='per_head'", HFConfigError),
    ("minimax_m2", "m2", lambda hf: hf.update(scoring_func="softmax"), "scoring_func='softmax'", HFConfigError),
    ("minimax_m2", "m2", lambda hf: hf.update(rotary_dim=4),
     "rotary_dim=4 disagrees with rope_parameters.partial_rotary_factor=0.6", HFConfigError),
    ("minimax_m2", "m2", lambda hf: hf.update(sliding_window=16), "sliding_window: not understood", HFConfigError),
    ("llama4_text", "llama4", lambda hf: hf.update(num_experts_per_tok=2), "num_experts_per_tok=2 is not supported",
     BOTH),
    ("llama4_text", "llama4", lambda hf: hf.update(rope_scaling=dict(rope_type="llama3", factor=8.0)),
     "rope_scaling=", BOTH),
    ("llama4_text", "llama4", lambda hf: hf.update(attention_bias=True), "attention_bias=True", BOTH),
    ("llama4_text", "llama4", lambda hf: hf.update(attention_chunk_size=None), "attention_chunk_size is null", BOTH),
    ("llama4_text", "llama4", lambda hf: hf.update(layer_types=["sliding_attention"] * 4), "layer_types=", BOTH),
    ("gpt_oss", "gpt_oss",
     lambda hf: hf.update(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}),
     "quantization_config (quant_method='mxfp4') is not supported", BOTH),
    ("gpt_oss", "gpt_oss",
     lambda hf: hf.update(layer_types=["sliding_attention", "chunked_attention", "full_attention", "full_attention"]),
     "layer_types has ['chunked_attention']", BOTH),
    ("gpt_oss", "gpt_oss", lambda hf: hf.update(attention_dropout=0.1), "attention_dropout=0.1", BOTH),
    ("gpt_oss", "gpt_oss", lambda hf: hf.update(swiglu_limit=-1.0), "moe.swiglu_limit=-1.0 must be > 0", BOTH),
    ("qwen3_next", "qwen3_next", lambda hf: hf["layer_types"].__setitem__(0, "sliding_attention"),
     "layer_types has ['sliding_attention']: only linear_attention (Gated DeltaNet) and full_attention", HFConfigError),
    ("qwen3_next", "qwen3_next", lambda hf: hf.update(layer_types=hf["layer_types"][:3]),
     "layer_types has 3 entries; num_hidden_layers=4", HFConfigError),
    ("qwen3_next", "qwen3_next", lambda hf: hf.update(attention_bias=True), "attention_bias=True", HFConfigError),
    ("qwen3_next", "qwen3_next", lambda hf: hf.update(hidden_act="gelu"), "hidden_act='gelu'", HFConfigError),
    ("qwen3_next", "qwen3_next", lambda hf: hf.update(use_sliding_window=True), "use_sliding_window=True",
     HFConfigError),
    ("qwen3_next", "qwen3_next", lambda hf: hf.update(linear_num_value_heads=5),
     "model.linear_num_value_heads=5 must be a multiple of model.linear_num_key_heads=2", BOTH),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(mla_use_nope=False), "mla_use_nope=False", HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(tie_word_embeddings=True), "tie_word_embeddings=True",
     HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(moe_renormalize=False), "norm_topk_prob=False",
     HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
     "mlp_layer_types=['sparse', 'dense', 'sparse', 'sparse'] is not supported", HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(layer_types=hf["layer_types"][:3]),
     "layer_types has 3 entries; num_hidden_layers=4", HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(linear_attn_config={"gate_lower_bound": -5.0}),
     "linear_attn_config sets gate_lower_bound", HFConfigError),
    ("kimi_linear", "kimi_linear", lambda hf: hf.update(num_nextn_predict_layers=1), "num_nextn_predict_layers=1",
     HFConfigError),
    ("kimi_linear", "kimi_linear",
     lambda hf: (hf.pop("layer_types"), hf.update(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [5]})),
     "linear_attn_config names layer 5: layers are 1 to 4", HFConfigError),
    ("longcat_flash", "longcat_flash", lambda hf: hf.update(head_dim=8),
     "head_dim=8 disagrees with qk_nope_head_dim=6 and qk_rope_head_dim=4 (expected 4)", HFConfigError),
    ("longcat_flash", "longcat_flash", lambda hf: hf.update(router_bias=True), "router_bias=True", HFConfigError),
    ("longcat_flash", "longcat_flash", lambda hf: hf.update(num_key_value_heads=2),
     "num_key_value_heads=2 must equal num_attention_heads=6", HFConfigError),
    ("longcat_flash", "longcat_flash", lambda hf: hf.update(attention_bias=True), "attention_bias=True",
     HFConfigError),
    ("longcat_flash", "longcat_flash", lambda hf: hf.update(moe_topk=10),
     "moe.topk=10 must be in [1, moe.num_experts + moe.zero_experts=9]", BOTH),
    ("deepseek_v32", "deepseek_v32", lambda hf: hf.update(q_lora_rank=None),
     "q_lora_rank is missing (required for deepseek_v32: the indexer reads the query latent)", HFConfigError),
    ("deepseek_v32", "deepseek_v32", lambda hf: hf.update(mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
     "mlp_layer_types=['dense', 'sparse', 'dense', 'sparse'] is not supported", HFConfigError),
    ("deepseek_v32", "deepseek_v32", lambda hf: hf.update(layer_types=["full_attention"] * 4),
     "layer_types=['full_attention', 'full_attention', 'full_attention', 'full_attention']: every layer", HFConfigError),
    ("deepseek_v32", "deepseek_v32", lambda hf: hf.update(index_topk=0), "model.index_topk=0 must be >= 1", BOTH),
    ("deepseek_v32", "deepseek_v32", lambda hf: hf.update(index_head_dim=2),
     "model.index_head_dim=2 must be >= model.qk_rope_head_dim=4", BOTH),
    ("glm_moe_dsa", "glm_moe_dsa_shared", lambda hf: hf.update(indexer_types=["full", "half", "full", "full"]),
     "indexer_types has ['half']: only full and shared are known", HFConfigError),
    ("glm_moe_dsa", "glm_moe_dsa_shared", lambda hf: hf.update(indexer_types=["full", "shared"]),
     "indexer_types has 2 entries; num_hidden_layers=4", HFConfigError),
    ("glm_moe_dsa", "glm_moe_dsa_shared", lambda hf: hf.update(indexer_types=["shared", "full", "full", "full"]),
     "model.indexer_types[0]='shared' must be full", BOTH),
    ("nemotron_h", "nemotron_h_latent", lambda hf: hf.update(moe_latent_size=0),
     "moe.latent_size=0 must be >= 1 when set", BOTH),
    ("nemotron_h", "nemotron_h", lambda hf: hf.update(mlp_hidden_act="silu"), "mlp_hidden_act='silu'", HFConfigError),
    ("nemotron_h", "nemotron_h", lambda hf: hf.update(tie_word_embeddings=True), "tie_word_embeddings=True",
     HFConfigError),
    ("nemotron_h", "nemotron_h", lambda hf: hf.update(use_conv_bias=False), "use_conv_bias=False", HFConfigError),
    ("nemotron_h", "nemotron_h", lambda hf: hf.update(mamba_proj_bias=True), "mamba_proj_bias=True", HFConfigError),
    ("nemotron_h", "nemotron_h", lambda hf: hf["layers_block_type"].__setitem__(0, "sliding_attention"),
     "layers_block_type has ['sliding_attention']", HFConfigError),
    ("nemotron_h", "nemotron_h", lambda hf: hf.update(n_groups=4), "model.mamba_num_heads=6 must be a multiple of "
     "model.mamba_num_groups=4", BOTH),
    ("qwen3_5_moe", "qwen3_5_moe", lambda hf: hf["rope_parameters"].update(mrope_section=[2, 1, 1]),
     "rope_parameters.mrope_section=[2, 1, 1] covers 8 rotary dims; head_dim=8 x partial_rotary_factor=0.25 has 2",
     HFConfigError),
]


@pytest.mark.parametrize("family, case, edit, named, errors", REFUSED,
                         ids=[f"{row[0]}-{row[3][:40]}" for row in REFUSED])
def test_unsupported_settings_are_refused_by_name(tmp_path, family, case, edit, named, errors):
    assert named in refused(model_of(family, case), tmp_path, edit, errors)


def test_every_family_refuses_an_unknown_key(tmp_path):
    """One refusal each: a key no importer reads is named, for every registered family."""
    for family in SPECS:
        text = refused(model_of(family), tmp_path / family, lambda hf: hf.update(no_such_key=3))
        assert f"no_such_key: not understood by moe-fold's {family} importer" in text, family


# --------------------------------------------------------------------------- DeepSeek-V2

def test_deepseek_v2_config_mapping():
    v2 = config_from_hf(model_of("deepseek_v2", "v2").config.to_dict())
    m, moe = v2.model, v2.moe
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.rope_interleave, m.rope_scaling) == ("mla", 14, 10, True,
                                                                                             "yarn")
    assert (m.yarn_mscale, m.yarn_mscale_all_dim, m.mtp_num_layers) == (0.707, 0.707, 0)
    assert (moe.score_function, moe.pre_softmax, moe.expert_bias) == ("softmax", True, False)
    assert (moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor) == (4, 2, "max", 2.5)
    assert (moe.first_k_dense, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == (1, 22, False)
    lite = config_from_hf(model_of("deepseek_v2", "lite").config.to_dict())
    assert (lite.model.q_lora_rank, lite.model.rope_scaling, lite.model.rope_theta) == (None, None, 5e4)
    assert (lite.moe.num_groups, lite.moe.scaling_factor, lite.moe.shared_expert_ffn_hidden_size) == (None, None, 44)


def _routed_as_its_config(model, ids):
    """Logits of a model built anew from ``model.config`` with ``model``'s weights: a router
    resolves its options when it is built, so a config changed afterwards routes only in a
    model built from it."""
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.model import build_model

    fresh = build_model(copy.deepcopy(model.config), ProcessGroups.single_process())
    fresh.load_state_dict(model.state_dict())
    return fresh.eval().logits(ids)


def test_deepseek_v2_export_takes_only_what_it_ranks_alike(tmp_path):
    """transformers ranks a group by its best score: Megatron-Core's topk_sum exports when
    topk = group_topk (the same ranking); a renormalised top-k, an expert bias or another
    family's name is refused by name, before anything is written."""
    model_of("deepseek_v2", "v2").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    ids = token_ids()
    want = model.logits(ids)
    moe = model.config.moe
    moe.group_score = "top2_sum"
    assert not torch.equal(_routed_as_its_config(model, ids), want)  # top2_sum routes otherwise
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
    two = _routed_as_its_config(model, ids)
    moe.group_score = "max"
    assert torch.equal(_routed_as_its_config(model, ids), two)
    moe.group_score = "topk_sum"
    to_hf(model, tmp_path / "megatron")
    assert torch.equal(from_hf(tmp_path / "megatron").eval().logits(ids), two)


# --------------------------------------------------------------------------- DeepSeek-V3

def test_deepseek_v3_config_mapping():
    config = config_from_hf(model_of("deepseek_v3", "q_lora_yarn").config.to_dict())
    m, moe = config.model, config.moe
    assert (m.num_heads, m.num_kv_heads, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim) == (6, 6, 14, 6, 4)
    assert m.rope_interleave and m.rope_scaling == "yarn"
    assert (m.yarn_factor, m.yarn_original_max_position_embeddings, m.yarn_mscale, m.yarn_mscale_all_dim) == (
        4.0, 16, 1.0, 0.8)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.topk) == ("sigmoid", True, 4, 2, 4)
    assert (moe.first_k_dense, moe.scaling_factor, moe.shared_expert_ffn_hidden_size) == (1, 2.5, 22)
    assert moe.group_score == "top2_sum"
    plain = config_from_hf(model_of("deepseek_v3", "no_q_lora").config.to_dict())
    assert plain.model.q_lora_rank is None and plain.model.rope_scaling is None and not plain.model.rope_interleave
    assert (plain.moe.num_groups, plain.moe.shared_expert_ffn_hidden_size, plain.model.rope_theta) == (None, 44, 5e4)


def test_deepseek_v3_checkpoint_loads_into_a_model_that_ranks_groups_alike():
    """A DeepSeek-V3 checkpoint (top2_sum) fits a model with Megatron-Core's topk_sum when
    topk = 2 x group_topk (the same ranking), not one with max."""
    from moe_fold.models.hf.importer import _architecture_mismatch

    theirs = config_from_hf(model_of("deepseek_v3", "q_lora_yarn").config.to_dict())
    ours = copy.deepcopy(theirs)
    ours.moe.group_score = "topk_sum"
    assert _architecture_mismatch(ours, theirs) == []
    ours.moe.group_score = "max"
    assert _architecture_mismatch(ours, theirs) == ["moe.group_score: the model has 'max', the checkpoint 'top2_sum'"]


def test_deepseek_v3_multi_token_prediction_tensors_are_refused(tmp_path):
    """With num_nextn_predict_layers=0 an MTP layer's tensors (model.layers.{num_hidden_layers}.*)
    have no place (tests/models/hf/test_mtp.py imports them when the config declares them)."""
    model_of("deepseek_v3", "no_q_lora").save_pretrained(tmp_path / "hf")
    saved = tensors(tmp_path / "hf")
    saved["model.layers.4.eh_proj.weight"] = torch.zeros(42, 84)
    save_file(saved, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(HFWeightError, match="model.layers.4.eh_proj.weight"):
        from_hf(tmp_path / "hf")


def test_deepseek_v3_export_refuses_what_it_cannot_hold(tmp_path):
    model_of("deepseek_v3", "no_q_lora").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="model.attention=mla: mixtral has standard attention"):
        to_hf(model, tmp_path / "out", family="mixtral")
    model.config.moe.shared_expert_gate = True
    with pytest.raises(HFConfigError, match="shared_expert_gate=true"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_deepseek_v3_export_takes_the_group_scores_it_ranks_alike(tmp_path):
    """transformers ranks a group by its best 2 scores: Megatron-Core's topk_sum exports when
    topk = 2 x group_topk (the same ranking: the re-import gives the same logits); max, or
    topk_sum with another ratio, is refused by name."""
    model_of("deepseek_v3", "q_lora_yarn").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    ids = token_ids()
    want = model.logits(ids)
    model.config.moe.group_score = "topk_sum"  # topk 4, group_topk 2: the best 2 scores
    assert torch.equal(_routed_as_its_config(model, ids), want)
    to_hf(model, tmp_path / "megatron")
    assert torch.equal(from_hf(tmp_path / "megatron").eval().logits(ids), want)
    model.config.moe.group_score = "max"
    assert not torch.equal(_routed_as_its_config(model, ids), want)  # max routes otherwise
    with pytest.raises(HFConfigError, match=r"moe.group_score=max with moe.topk=4 and moe.group_topk=2: .* "
                                            r"rank a group by the sum of its best 2 scores, this model by its best 1"):
        to_hf(model, tmp_path / "max")
    model.config.moe.group_score, model.config.moe.group_topk = "topk_sum", 4
    with pytest.raises(HFConfigError, match="moe.group_score=topk_sum with moe.topk=4 and moe.group_topk=4"):
        to_hf(model, tmp_path / "ratio")
    assert not (tmp_path / "max").exists() and not (tmp_path / "ratio").exists()


def test_other_families_reset_an_mla_base():
    """A Mixtral config.json over the deepseek-v3 preset as base gives standard attention."""
    from moe_fold.config import validate

    config = config_from_hf(model_of("mixtral").config.to_dict(), load_config("deepseek-v3-tiny"))
    m = config.model
    assert (m.attention, m.kv_lora_rank, m.rope_scaling, m.yarn_factor, m.rope_interleave) == ("mha", None, None,
                                                                                                  None, False)
    validate(config, 1)


# --------------------------------------------------------------------------- GLM-4.5, OLMoE

def test_glm4_moe_and_olmoe_config_mapping():
    glm = config_from_hf(model_of("glm4_moe").config.to_dict())
    m, moe = glm.model, glm.moe
    assert (m.partial_rotary_factor, m.qkv_bias, m.qk_norm, m.qk_norm_scope, m.head_dim) == (0.5, True, True, "head", 8)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.topk) == ("sigmoid", True, 4, 2, 4)
    assert (moe.first_k_dense, moe.scaling_factor, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == (
        1, 2.5, 22, False)
    assert moe.group_score == "top2_sum"
    olmoe = config_from_hf(model_of("olmoe").config.to_dict())
    m, moe = olmoe.model, olmoe.moe
    assert (m.qk_norm, m.qk_norm_scope, m.partial_rotary_factor, m.rope_theta) == (True, "projection", 1.0, 5e4)
    assert (moe.pre_softmax, moe.score_function, moe.num_experts, moe.topk, moe.ffn_hidden_size) == (
        True, "softmax", 8, 3, 22)


def test_glm4_moe_and_olmoe_export_refuses_what_the_family_cannot_hold(tmp_path):
    model_of("olmoe").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="model.qk_norm_scope=projection: qwen3_moe normalises each head"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    model_of("glm4_moe").save_pretrained(tmp_path / "glm")
    model = from_hf(tmp_path / "glm")
    with pytest.raises(HFConfigError, match="model.partial_rotary_factor=0.5: mixtral rotates the whole head"):
        to_hf(model, tmp_path / "out", family="mixtral")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- ERNIE-4.5

def test_ernie4_5_moe_config_mapping():
    a3b = config_from_hf(model_of("ernie4_5_moe", "a3b").config.to_dict())
    m, moe = a3b.model, a3b.moe
    assert (m.rope_interleave, m.tie_embeddings, m.head_dim, m.num_kv_heads, m.rope_theta) == (True, True, 8, 2, 5e5)
    assert (moe.score_function, moe.pre_softmax, moe.expert_bias, moe.topk_norm_min) == ("softmax", True, True, 1e-12)
    assert (moe.moe_layer_freq, moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate) == ([0, 1, 1, 1], 44,
                                                                                               False)
    interval = config_from_hf(model_of("ernie4_5_moe", "interval").config.to_dict())
    assert interval.moe.moe_layer_freq == [0, 1, 0, 1, 0, 0]
    assert (interval.moe.topk_norm_min, interval.moe.shared_expert_ffn_hidden_size, interval.model.head_dim) == (
        0.6, 0, 10)


def test_ernie4_5_moe_export_refuses_what_it_cannot_hold(tmp_path):
    model_of("ernie4_5_moe", "a3b").save_pretrained(tmp_path / "hf")
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


# --------------------------------------------------------------------------- MiniMax-M2

def test_minimax_m2_config_mapping():
    m2 = config_from_hf(model_of("minimax_m2", "m2").config.to_dict())
    m, moe = m2.model, m2.moe
    assert (m.head_dim, m.partial_rotary_factor, m.qk_norm, m.qk_norm_scope, m.rope_theta) == (10, 0.6, True,
                                                                                              "projection", 5e6)
    assert (moe.score_function, moe.expert_bias, moe.pre_softmax, moe.topk, moe.ffn_hidden_size) == (
        "sigmoid", True, False, 3, 22)
    assert (moe.num_groups, moe.scaling_factor, moe.shared_expert_ffn_hidden_size, moe.moe_layer_freq) == (
        None, None, 0, 1)
    full = config_from_hf(model_of("minimax_m2", "full_rotary").config.to_dict())
    assert (full.model.partial_rotary_factor, full.model.tie_embeddings, full.moe.input_jitter) == (1.0, True, 0.05)


def test_minimax_m2_export_refuses_what_it_cannot_hold(tmp_path):
    model_of("minimax_m2", "m2").save_pretrained(tmp_path / "hf")
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


# --------------------------------------------------------------------------- Llama-4

def test_llama4_text_config_mapping():
    config = config_from_hf(model_of("llama4_text").config.to_dict())
    m, moe = config.model, config.moe
    assert (m.attention_chunk, m.local_attention_layers, m.rope_layers) == (5, [1, 1, 1, 0], [1, 1, 1, 0])
    assert (m.qk_norm, m.qk_norm_scope, m.rope_interleave, m.head_dim, m.ffn_hidden_size) == (True, "l2", True, 8, 50)
    assert (m.attn_temperature_tuning, m.attn_temperature_floor, m.attn_temperature_scale) == (True, 4, 0.3)
    assert (moe.score_function, moe.topk, moe.score_on_input, moe.num_experts, moe.ffn_hidden_size) == (
        "sigmoid", 1, True, 6, 22)
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, moe.moe_layer_freq) == (22, False, [0, 1, 0, 1])


def test_llama4_text_export_refuses_what_the_family_cannot_hold(tmp_path):
    model_of("llama4_text").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="moe.score_on_input=true: mixtral scales each expert's output"):
        to_hf(model, tmp_path / "out", family="mixtral")
    with pytest.raises(HFConfigError, match="model.attention_chunk=5: qwen3_moe has no such attention setting"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    assert not (tmp_path / "out").exists()


def test_llama4_text_trained_preset_exports_and_generates_what_sample_gives(tmp_path):
    """llama4-tiny trained 12 steps from the preset (chunks of 8, temperature floor 4, so
    both act inside the 32 tokens sampled), converted by the CLI: transformers'
    AutoTokenizer + AutoModelForCausalLM.generate give ``moe-fold sample``'s greedy tokens."""
    import warnings

    import transformers

    from moe_fold.cli import main
    from moe_fold.data.hf_tokenizer import prompt_ids
    from moe_fold.data.tokenizer import load_tokenizer
    from moe_fold.training.train import train
    from tests.models.test_sampling import GREEDY, PROMPT, _ours

    config = load_config("llama4-tiny", [
        "model.hidden_size=64", "model.seq_length=64", "model.attention_chunk=8", "model.attn_temperature_floor=4",
        "train.steps=12", "train.save_every=12", "train.micro_batch_size=4", "train.global_batch_size=8",
        "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
        f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    checkpoint = Path(train(config, progress=False).checkpoint)
    out = tmp_path / "hf"
    assert main(["convert", str(checkpoint), str(out), "--no-progress"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is transformers.Llama4ForCausalLM
    enc = tokenizer(PROMPT, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == prompt_ids(load_tokenizer("byte"), PROMPT)
    hf = model.generate(**enc, max_new_tokens=GREEDY["max_new_tokens"], do_sample=False)
    new = hf[0, enc["input_ids"].shape[1]:].tolist()
    assert new == _ours(checkpoint, "byte", GREEDY)[0]


# --------------------------------------------------------------------------- gpt-oss

def test_gpt_oss_every_feature_changes_the_logits():
    """The sliding window, the sinks, the clamp and the biases each move transformers'
    logits here, so a match above is not a match of a model without them."""
    ids = token_ids()
    ref = hf_logits(model_of("gpt_oss"), ids)
    for overrides in (dict(sliding_window=64), dict(swiglu_limit=100.0)):
        assert max_diff(hf_logits(model_of("gpt_oss", **overrides), ids), ref) > 1e-3, overrides
    for name in ("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias", "o_proj.bias"):
        model = model_of("gpt_oss")
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(name):
                    p.zero_()
        assert max_diff(hf_logits(model, ids), ref) > 1e-3, name


def test_gpt_oss_config_mapping():
    config = config_from_hf(model_of("gpt_oss").config.to_dict())
    m, moe = config.model, config.moe
    assert (m.qkv_bias, m.attention_out_bias, m.attention_sinks, m.sliding_window) == (True, True, True, 5)
    assert m.local_attention_layers == [1, 0, 1, 0]
    assert (m.rope_scaling, m.yarn_factor, m.yarn_truncate, m.rope_theta) == ("yarn", 32.0, False, 150000.0)
    assert (moe.router_bias, moe.expert_linear_bias, moe.activation, moe.swiglu_limit) == (
        True, True, "clamped_swiglu", 1.3)
    assert (moe.score_function, moe.pre_softmax, moe.num_experts, moe.topk, moe.ffn_hidden_size) == (
        "softmax", False, 6, 3, 22)
    # Every layer sliding: no per-layer list; no window at all: none.
    every = config_from_hf(model_of("gpt_oss", layer_types=["sliding_attention"] * 4).config.to_dict()).model
    assert (every.sliding_window, every.local_attention_layers) == (5, None)
    full = config_from_hf(model_of("gpt_oss", layer_types=["full_attention"] * 4).config.to_dict()).model
    assert (full.sliding_window, full.local_attention_layers) == (0, None)


def test_gpt_oss_export_refuses_what_the_family_cannot_hold(tmp_path):
    model_of("gpt_oss").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="mixtral")
    for field in ("moe.router_bias=true", "moe.expert_linear_bias=true", "moe.activation=clamped_swiglu",
                  "model.attention_out_bias=true", "model.attention_sinks=True",
                  "model.local_attention_layers=[1, 0, 1, 0]", "model.rope_scaling=yarn"):
        assert field in str(err.value), field
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- Qwen3-Next and Qwen3.5

def test_qwen3_next_config_mapping():
    m, moe = (lambda c: (c.model, c.moe))(config_from_hf(model_of("qwen3_next", "qwen3_next").config.to_dict()))
    assert m.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    assert (m.attn_output_gate, m.norm_zero_centred, m.qk_norm, m.partial_rotary_factor) == (True, True, True, 0.25)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
            m.linear_conv_kernel) == (2, 6, 6, 5, 4)
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.pre_softmax, moe.moe_layer_freq) == (
        4, 2, 22, False, [1, 0, 1, 1])
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, m.ffn_hidden_size) == (30, True, 50)
    mixed = config_from_hf(model_of("qwen3_next", "qwen3_next_mixed").config.to_dict())
    assert mixed.model.layer_types == ["attention", "gated_deltanet"] * 2 and mixed.moe.pre_softmax


def test_qwen3_5_moe_reads_the_multimodal_wrapper_and_refuses_a_vision_tower():
    """The wrapper's config.json (``model_type: qwen3_5_moe``, the text model under
    ``text_config``) maps as the text model's own does; with a vision tower it is refused,
    naming ``vision_config``; its tensors are read under ``model.language_model.``."""
    text = model_of("qwen3_5_moe").config.to_dict()
    base = load_config("mixtral-tiny")  # the wrapper's max_position_embeddings is the text model's: no seq_length
    flat = config_from_hf(text, base)
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")},
               "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
               "vision_end_token_id": 248054, "tie_word_embeddings": False}
    wrapped = config_from_hf(wrapper, base)
    assert wrapped.model == flat.model and wrapped.moe == flat.moe
    assert wrapped.model.layer_types == ["gated_deltanet"] * 3 + ["attention"]
    with pytest.raises(HFConfigError, match=r"vision_config is set \(a vision tower of depth 27\): moe-fold imports "
                                            r"the text model of qwen3_5_moe only"):
        config_from_hf({**wrapper, "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27}})
    with pytest.raises(HFConfigError, match=r"text_config.no_such_key: not understood"):
        config_from_hf({**wrapper, "text_config": {**wrapper["text_config"], "no_such_key": 1}})
    from moe_fold.models.hf.weights import weight_sources

    inner = weight_sources(flat, "qwen3_5_moe", frozenset({"model.language_model.embed_tokens.weight"}))
    assert inner["layers.0.attn.A_log"].name == "model.language_model.layers.0.linear_attn.A_log"


# Qwen3-Next-80B-A3B's config.json (Qwen/Qwen3-Next-80B-A3B-Instruct, transformers 4.57 keys).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_qwen3_next_released_config_imports_to_our_preset():
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("qwen3-next-80b-a3b")
    assert _architecture_mismatch(ours, config_from_hf(QWEN3_NEXT_80B, ours)) == []


def test_qwen3_5_35b_a3b_config_imports_to_our_preset():
    """transformers' Qwen3_5MoeTextConfig defaults are Qwen3.5-35B-A3B's text model (its
    docstring's checkpoint); the release's rope_parameters (theta 1e7, the multimodal
    sections, interleaved) replace the generic rotary default."""
    from transformers import Qwen3_5MoeTextConfig

    from moe_fold.models.hf.importer import _architecture_mismatch

    rope = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    released = Qwen3_5MoeTextConfig(rope_parameters=rope).to_dict()
    ours = load_config("qwen3.5-35b-a3b")
    assert _architecture_mismatch(ours, config_from_hf(released, ours)) == []


def test_qwen3_next_and_qwen3_5_exports_refuse_what_they_cannot_hold(tmp_path):
    model_of("qwen3_next", "qwen3_next").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="qwen3_5_moe")  # layer 1 is dense
    assert "MoE layers [1, 0, 1, 1]: every Qwen3.5 MoE layer is MoE" in str(err.value)
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    for field in ("model.layer_types=['gated_deltanet', 'gated_deltanet', 'gated_deltanet', 'attention']",
                  "model.attn_output_gate=true", "model.norm_zero_centred=true"):
        assert field in str(err.value), field
    model.config.model.attn_output_gate = False
    with pytest.raises(HFConfigError, match="model.attn_output_gate=false: qwen3_next's attention always has"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- Kimi-Linear

def test_kimi_linear_config_mapping():
    """The tiny models' config.json (transformers' key names) and the original checkpoint's
    (``linear_attn_config`` with 1-based layer lists, Kimi's MoE names) map alike."""
    hf = model_of("kimi_linear", "kimi_linear").config.to_dict()
    config = config_from_hf(hf)
    m, moe = config.model, config.moe
    assert m.layer_types == ["kda"] * 3 + ["attention"]
    assert (m.attention, m.rope_layers, m.mla_norm_eps, m.q_lora_rank, m.kv_lora_rank) == ("mla", [0] * 4, 1e-6,
                                                                                           None, 10)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
            m.linear_conv_kernel) == (4, 4, 5, 5, 4)
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size, moe.first_k_dense,
            moe.scaling_factor, moe.score_function, moe.expert_bias) == (8, 3, 22, 22, 1, 2.5, "sigmoid", True)
    original = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types", "linear_num_heads",
                                                          "linear_head_dim", "linear_conv_kernel_dim")}
    original.update(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4,
                                        "head_dim": 5, "short_conv_kernel_size": 4},
                    moe_router_activation_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=0)
    assert config_from_hf(original) == config
    groups = config_from_hf(model_of("kimi_linear", "kimi_linear_groups").config.to_dict())
    assert (groups.model.layer_types, groups.moe.num_groups, groups.moe.group_topk, groups.moe.first_k_dense,
            groups.model.q_lora_rank) == (["attention", "kda", "kda", "attention"], 4, 2, 0, 14)


def test_kimi_linear_reads_the_original_checkpoints_dense_mlp(tmp_path):
    """The original checkpoint holds a dense layer's MLP under ``mlp.`` (transformers saves it
    under ``block_sparse_moe.``): both import to the same model."""
    model = model_of("kimi_linear", "kimi_linear")
    model.save_pretrained(tmp_path / "hf")
    saved = tensors(tmp_path / "hf")
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in saved.items()}
    assert renamed != saved
    save_file(renamed, str(tmp_path / "hf" / "model.safetensors"))
    ids = token_ids()
    assert max_diff(from_hf(tmp_path / "hf").eval().logits(ids), hf_logits(model, ids)) <= 1e-5


# Kimi-Linear-48B-A3B's config.json (moonshotai/Kimi-Linear-48B-A3B-Instruct): its architecture keys.
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "hidden_act": "silu",
    "initializer_range": 0.02, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "model_max_length": 1048576,
    "rope_theta": 10000.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8,
    "num_shared_experts": 1, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1,
    "topk_group": 1, "num_nextn_predict_layers": 0, "use_cache": True, "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4}}


def test_kimi_linear_released_config_imports_to_our_preset():
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("kimi-linear-48b-a3b")
    assert _architecture_mismatch(ours, config_from_hf(KIMI_LINEAR_48B, ours)) == []


def test_kimi_linear_export_refuses_what_it_cannot_hold(tmp_path):
    model_of("kimi_linear", "kimi_linear").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    m = model.config.model
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="qwen3_next")
    assert "qwen3_next's linear layers are Gated DeltaNet, not KDA" in str(err.value)
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="deepseek_v3")
    # DeepSeek-V3's latent norms have Kimi's epsilon, 1e-6: not a problem.
    assert "mla_norm_eps" not in str(err.value)
    for field in ("model.layer_types=['kda', 'kda', 'kda', 'attention']", "model.rope_layers=[0, 0, 0, 0]"):
        assert field in str(err.value), field
    m.rope_layers = [0, 0, 0, 1]
    with pytest.raises(HFConfigError, match=r"model.rope_layers=\[0, 0, 0, 1\]: kimi_linear's MLA has no rotary"):
        to_hf(model, tmp_path / "out")
    m.rope_layers, m.mla_norm_eps = [0] * 4, None
    with pytest.raises(HFConfigError, match="model.mla_norm_eps=None \\(model.norm_eps=1e-05\\): kimi_linear's MLA"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- LongCat-Flash

def test_longcat_flash_config_mapping():
    config = config_from_hf(model_of("longcat_flash", "longcat_flash").config.to_dict())
    m, moe = config.model, config.moe
    assert (m.block, m.num_layers, m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == (
        "shortcut_moe", 2, "mla", 14, 10, 5)
    assert (m.mla_lora_scale, m.mla_norm_eps, m.norm_eps, m.rope_interleave, m.rope_theta) == (
        True, 1e-6, 1e-5, True, 1e7)
    assert (moe.num_experts, moe.zero_experts, moe.topk, moe.ffn_hidden_size, m.ffn_hidden_size) == (6, 3, 4, 22, 50)
    assert (moe.score_function, moe.pre_softmax, moe.expert_bias, moe.scaling_factor) == ("softmax", True, True, 6.0)
    assert (moe.moe_layer_freq, moe.first_k_dense, moe.shared_expert_ffn_hidden_size) == (1, 0, 0)
    tied = config_from_hf(model_of("longcat_flash", "longcat_yarn_tied").config.to_dict())
    assert (tied.model.rope_scaling, tied.model.tie_embeddings, tied.moe.scaling_factor) == ("yarn", True, None)


def test_longcat_flash_released_config_imports_to_our_preset():
    """transformers' LongcatFlashConfig defaults follow meituan-longcat/LongCat-Flash-Chat."""
    import transformers

    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("longcat-flash")
    assert _architecture_mismatch(ours, config_from_hf(transformers.LongcatFlashConfig().to_dict(), ours)) == []


def test_longcat_flash_export_refuses_what_it_cannot_hold(tmp_path):
    model_of("longcat_flash", "longcat_flash").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="deepseek_v3")
    assert "mla_norm_eps" not in str(err.value)  # DeepSeek-V3's latent norms have LongCat's epsilon, 1e-6
    for field in ("model.block=shortcut_moe", "model.mla_lora_scale=true",
                  "moe.zero_experts=3: deepseek_v3 has no zero-computation experts"):
        assert field in str(err.value), field
    model.config.model.mla_norm_eps = None  # the latents' norms would take norm_eps 1e-5
    with pytest.raises(HFConfigError, match="model.mla_norm_eps=1e-05: transformers' LongCat-Flash latent norms"):
        to_hf(model, tmp_path / "out")
    model.config.model.mla_norm_eps, model.config.moe.expert_bias = 1e-6, False
    with pytest.raises(HFConfigError, match="moe.expert_bias=false: the router always has its score correction bias"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dsa_config_mapping():
    """DeepSeek-V3.2 and GLM-5 read as DeepSeek-V3's model with DSA: the indexer's sizes, its
    rotary (halves, GLM-5's pairs), GLM-5's shared layers, the MLA latent norms' epsilon."""
    v32 = config_from_hf(model_of("deepseek_v32").config.to_dict())
    m = v32.model
    assert (m.attention, m.q_lora_rank, m.rope_interleave, m.mla_norm_eps) == ("mla", 14, True, 1e-6)
    assert (m.dsa, m.index_n_heads, m.index_head_dim, m.index_topk, m.index_rope_interleave, m.indexer_types) == (
        True, 8, 8, 5, False, None)
    assert (v32.moe.score_function, v32.moe.expert_bias, v32.moe.first_k_dense, v32.model.mtp_num_layers) == (
        "sigmoid", True, 1, 0)
    glm = config_from_hf(model_of("glm_moe_dsa").config.to_dict()).model
    assert (glm.index_rope_interleave, glm.indexer_types, glm.norm_eps) == (True, ["full", "shared", "full", "shared"],
                                                                           1e-5)
    assert config_from_hf(model_of("glm_moe_dsa", "glm_moe_dsa_full").config.to_dict()).model.indexer_types is None


def test_dsa_exports_refuse_what_they_cannot_hold(tmp_path):
    model_of("glm_moe_dsa").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="deepseek_v32")
    assert "model.index_rope_interleave=true: deepseek_v32's indexer rotates two halves" in str(err.value)
    assert "model.indexer_types=['full', 'shared', 'full', 'shared']: every deepseek_v32 layer" in str(err.value)
    with pytest.raises(HFConfigError, match="model.dsa=true: deepseek_v3 has dense attention"):
        to_hf(model, tmp_path / "out", family="deepseek_v3")
    model.config.model.mla_norm_eps = None  # norm_eps 1e-5 then
    with pytest.raises(HFConfigError, match="model.mla_norm_eps=None .model.norm_eps=1e-05.: glm_moe_dsa's latent"):
        to_hf(model, tmp_path / "out")


# --------------------------------------------------------------------------- Nemotron-H

def test_nemotron_3_nano_dimensions_import_to_our_preset():
    """Nemotron 3 Nano 30B-A3B's published dimensions (its hybrid_override_pattern and
    sizes, the rest transformers' defaults), as transformers' NemotronHConfig writes them,
    import to the nemotron-3-nano-30b-a3b preset."""
    import transformers

    from moe_fold.models.hf.importer import _architecture_mismatch

    nano = transformers.NemotronHConfig(
        vocab_size=131072, hidden_size=2688, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=21504, mamba_num_heads=64,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, n_routed_experts=128,
        num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
        routed_scaling_factor=2.5, layer_norm_epsilon=1e-5, max_position_embeddings=262144)
    ours = load_config("nemotron-3-nano-30b-a3b")
    assert _architecture_mismatch(ours, config_from_hf(nano.to_dict(), ours)) == []


def test_nemotron_h_exports_refuse_what_they_cannot_hold(tmp_path):
    """Nemotron-H's model refuses other families by field; its own export refuses
    rotary attention and SwiGLU experts."""
    model_of("nemotron_h", "nemotron_h").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family="qwen3_next")
    for field in ("model.block=single_mixer", "model.mlp_activation=relu2", "no Mamba2 layers"):
        assert field in str(err.value), field
    model.config.model.rope_layers = [1] * 6
    model.config.moe.activation = "swiglu"
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out")
    for field in ("model.rope_layers=[1, 1, 1, 1, 1, 1]: Nemotron-H's attention has no rotary",
                  "moe.activation=swiglu: Nemotron-H's experts are relu2"):
        assert field in str(err.value), field
    assert not (tmp_path / "out").exists()
