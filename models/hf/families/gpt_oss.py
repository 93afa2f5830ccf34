"""gpt-oss (``GptOssForCausalLM``, docs/families/gpt-oss.md): ``attention_bias`` on q, k, v
and o (``model.qkv_bias``, ``model.attention_out_bias``), attention sinks, a sliding window
on the ``layer_types`` ``sliding_attention`` layers, YaRN without truncation
(``model.yarn_truncate: false``); a router with bias and softmax over the top-k logits
(``moe.router_bias``, ``pre_softmax: false``); experts with biases and the clamped SwiGLU
(``moe.expert_linear_bias``, ``moe.activation: clamped_swiglu``, ``swiglu_alpha``,
``swiglu_limit``). MXFP4 checkpoints (``quantization_config``) are refused.

Tensors: ``self_attn.{q,k,v,o}_proj.bias``, ``self_attn.sinks``, ``mlp.router.{weight,bias}``
and the experts fused as ``[in, out]`` (``mlp.experts.gate_up_proj [E, H, 2F]`` with gate and
up interleaved, de-interleaved by :class:`~moe_fold.models.hf.sources.Halves`,
``gate_up_proj_bias``, ``down_proj [E, F, H]``, ``down_proj_bias``), read and written in
that form."""

from __future__ import annotations

from moe_fold.config import Config, head_dim

from ..sources import Halves, Source, Take
from .base import (Family, Keys, MoeNames, Refuse, attention_heads, common_sizes, mlp_sources, num_experts,
                   rope_to_hf, yarn_rope)


def _attention_from_hf(keys: Keys, m) -> None:
    """gpt-oss's attention features: sinks on every layer, a sliding window of
    ``sliding_window`` keys (the query's own included) on the ``sliding_attention`` layers
    of ``layer_types`` (transformers' default: the even layers)."""
    m.attention_sinks = True
    layer_types = keys.get("layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(m.num_layers)]
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        keys.problems.append(f"layer_types has {odd}: only full_attention and sliding_attention are known")
    if len(layer_types) != m.num_layers:
        keys.problems.append(f"layer_types has {len(layer_types)} entries for num_hidden_layers={m.num_layers}")
    window = keys.get("sliding_window", None)
    flags = [int(kind == "sliding_attention") for kind in layer_types]
    if window is None or not any(flags):
        m.sliding_window, m.local_attention_layers = 0, None
    else:
        m.sliding_window = int(window)
        m.local_attention_layers = None if all(flags) else flags


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    quant = keys.get("quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        keys.problems.append(f"quantization_config (quant_method={method!r}) is not supported: moe-fold reads "
                             f"bfloat16/float32 gpt-oss checkpoints only; dequantize first (transformers: "
                             f"from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)), then "
                             f"save_pretrained)")
    common_sizes(keys, m, "gpt_oss")
    attention_heads(keys, m)
    m.qk_norm, m.partial_rotary_factor = False, 1.0
    # attention_bias covers all four projections here (q|k|v and o).
    m.qkv_bias = m.attention_out_bias = bool(keys.get("attention_bias", True))
    yarn_rope(keys, m)
    _attention_from_hf(keys, m)
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    # The experts' activation is the clamped SwiGLU whatever hidden_act says (transformers ignores it too).
    keys.get("hidden_act", None)
    moe.num_experts = num_experts(keys, "num_local_experts", "num_experts")
    moe.topk = keys.get("num_experts_per_tok")
    moe.ffn_hidden_size = keys.get("intermediate_size")
    m.ffn_hidden_size = moe.ffn_hidden_size  # no dense layers; kept equal for a tidy config
    moe.moe_layer_freq, moe.first_k_dense = 1, 0
    moe.score_function, moe.pre_softmax, moe.num_groups, moe.group_topk = "softmax", False, None, None
    moe.group_score, moe.scaling_factor, moe.expert_bias, moe.input_jitter = "topk_sum", None, False, 0.0
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.router_bias, moe.expert_linear_bias, moe.activation = True, True, "clamped_swiglu"
    moe.swiglu_alpha = float(keys.get("swiglu_alpha", 1.702))
    moe.swiglu_limit = float(keys.get("swiglu_limit", 7.0))


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(m.qk_norm, "model.qk_norm=true: gpt-oss has no QK-norm")
    refuse(m.qkv_bias != m.attention_out_bias,
           f"model.qkv_bias={m.qkv_bias} with model.attention_out_bias={m.attention_out_bias}: gpt-oss's "
           f"attention_bias sets both")
    refuse(not m.attention_sinks, "model.attention_sinks=false: gpt-oss's attention always has sinks")
    refuse(m.attention_chunk > 0, f"model.attention_chunk={m.attention_chunk}: gpt-oss has no chunked attention")
    refuse(m.rope_layers is not None, "model.rope_layers is set: every gpt-oss layer has rotary embeddings")
    refuse(m.attn_temperature_tuning, "model.attn_temperature_tuning=true: gpt-oss has no temperature tuning")
    refuse(m.rope_interleave, "model.rope_interleave=true: gpt-oss rotates two halves of each head")
    refuse(moe.score_on_input, "moe.score_on_input=true: gpt-oss scales each expert's output by its prob")
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every gpt-oss layer is MoE")
    refuse(moe.score_function != "softmax" or moe.pre_softmax,
           f"moe.score_function={moe.score_function}, moe.pre_softmax={moe.pre_softmax}: gpt-oss takes the softmax "
           f"of the top-k logits (softmax, pre_softmax=false)")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: gpt-oss has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: gpt-oss does not scale probs")
    refuse(moe.expert_bias, "moe.expert_bias=true: gpt-oss's router has a learned bias, not an expert bias")
    refuse(moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: gpt-oss has no shared expert")
    refuse(not moe.router_bias, "moe.router_bias=false: gpt-oss's router always has a bias")
    refuse(not moe.expert_linear_bias, "moe.expert_linear_bias=false: gpt-oss's experts always have biases")
    refuse(moe.activation != "clamped_swiglu",
           f"moe.activation={moe.activation}: gpt-oss's experts use the clamped SwiGLU")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    local = [bool(f) for f in (m.local_attention_layers or [1] * m.num_layers)]
    sliding = m.sliding_window > 0
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": moe.ffn_hidden_size, "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "attention_dropout": 0.0, "attention_bias": m.qkv_bias,
        "rope_parameters": rope_to_hf(m),
        "layer_types": ["sliding_attention" if sliding and f else "full_attention" for f in local],
        "sliding_window": m.sliding_window if sliding else None,
        "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }


_dense = mlp_sources(MoeNames())


def _mlp_sources(config: Config, hf: str, ours: str, is_moe: bool, hf_names: frozenset) -> dict[str, Source]:
    """gpt-oss's MoE block: a router with bias, and experts stored fused as ``[in, out]``
    (our layout) with biases, gate and up interleaved in ``gate_up_proj`` and its bias."""
    if not is_moe:
        return _dense(config, hf, ours, is_moe, hf_names)
    hf, ours = f"{hf}mlp.", f"{ours}mlp."
    return {f"{ours}router.weight": Take(f"{hf}router.weight"), f"{ours}router.bias": Take(f"{hf}router.bias"),
            f"{ours}experts.fc1": Halves(Take(f"{hf}experts.gate_up_proj"), 2),  # [E, H, 2F]
            f"{ours}experts.fc1_bias": Halves(Take(f"{hf}experts.gate_up_proj_bias"), 1),  # [E, 2F]
            f"{ours}experts.fc2": Take(f"{hf}experts.down_proj"),  # [E, F, H]
            f"{ours}experts.fc2_bias": Take(f"{hf}experts.down_proj_bias")}  # [E, H]


FAMILY = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM",
    # Each attention feature is let through to refusals(), which names what gpt-oss holds.
    features=frozenset({"router_bias", "expert_linear_bias", "expert_activation", "attention_out_bias", "yarn",
                        "attention_sinks", "sliding_window", "attention_chunk", "rope_layers",
                        "attn_temperature_tuning", "score_on_input"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: (config.moe.router_bias or config.moe.expert_linear_bias
                            or config.moe.activation == "clamped_swiglu" or config.model.attention_sinks),
    export_priority=40, mlp_sources=_mlp_sources)
