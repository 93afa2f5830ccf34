"""GLM-4.5 (``Glm4MoeForCausalLM``, docs/families/glm4-moe.md): DeepSeek-V3's MoE layers,
routing and MTP with grouped-query attention: q|k|v biases (``attention_bias``), per-head
QK-norm (``use_qk_norm``) and rotary on the first ``partial_rotary_factor`` of each head."""

from __future__ import annotations

from moe_fold.config import Config, head_dim

from .base import Family, Keys, Refuse, attention_heads, common_sizes, rope_theta
from .deepseek_common import MOE_NAMES_BIASED, deepseek_moe_from_hf, deepseek_moe_refusals, deepseek_moe_to_hf


def from_hf(keys: Keys, config: Config) -> None:
    m = config.model
    common_sizes(keys, m, "glm4_moe")
    attention_heads(keys, m)
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.qkv_bias = bool(keys.get("attention_bias", False))
    m.qk_norm = bool(keys.get("use_qk_norm", False))
    params = keys.get("rope_parameters", {})
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    # transformers' Glm4MoeConfig defaults the factor to 0.5 when neither place sets it.
    m.partial_rotary_factor = float(inner if inner is not None else keys.get("partial_rotary_factor", 0.5))
    m.rope_theta = rope_theta(keys, 1e4, partial_rotary=True)
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    coeff = keys.get("router_aux_loss_coef", None)
    if coeff is not None:
        config.moe.aux_loss_coeff = float(coeff)
    deepseek_moe_from_hf(keys, config)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m = config.model
    refuse(m.qk_norm and m.qk_norm_scope != "head",
           f"model.qk_norm_scope={m.qk_norm_scope}: GLM-4.5's QK-norm is per head")
    deepseek_moe_refusals(config, flags, refuse)


def to_hf(config: Config, flags: list) -> dict:
    m = config.model
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": m.qkv_bias, "use_qk_norm": m.qk_norm, "router_aux_loss_coef": config.moe.aux_loss_coeff,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        **deepseek_moe_to_hf(config),
    }


FAMILY = Family(
    model_type="glm4_moe", architecture="Glm4MoeForCausalLM",
    # The exporter lets a non-head QK-norm scope through to refusals(), which names GLM-4.5's.
    features=frozenset({"qk_norm_scope", "partial_rotary", "mtp"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: (config.moe.expert_bias or config.model.partial_rotary_factor != 1.0
                            or config.model.mtp_num_layers > 0),
    export_priority=70, moe_names=MOE_NAMES_BIASED)
