"""ERNIE-4.5-MoE (``Ernie4_5_MoeForCausalLM``, docs/families/ernie-4.5-moe.md):
grouped-query attention with interleaved rotary pairs; layer ``i`` is MoE when ``(i + 1) %
moe_layer_interval == 0`` and ``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the
last layer); softmax over all experts, the expert bias
(``mlp.moe_statics.e_score_correction_bias`` ``[1, E]``) added for selection only, the k chosen
softmax values divided by max(their sum, ``moe_norm_min``) (our ``pre_softmax``,
``expert_bias`` and ``topk_norm_min``); ungated shared experts of ``moe_intermediate_size``
each, DeepSeek-V3's tensor names."""

from __future__ import annotations

from typing import Optional

from moe_fold.config import Config, head_dim

from ..sources import FirstRow
from .base import Family, Keys, MoeNames, Refuse, attention_heads, common_sizes, num_experts, rope_theta


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    common_sizes(keys, m, "ernie4_5_moe", tie=True)
    attention_heads(keys, m)
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.rope_theta = rope_theta(keys, 5e5)
    m.qk_norm, m.qkv_bias = False, False
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("use_bias", (False,), "ERNIE-4.5's use_bias puts biases on every linear (q, k, v, o and the "
                                       "MLPs); moe-fold has q|k|v biases only")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    moe.num_experts = num_experts(keys, "moe_num_experts", "num_experts")
    topk = keys.get("num_experts_per_tok", None)
    moe.topk = keys.get("moe_k") if topk is None else keys.get("moe_k", topk)
    moe.ffn_hidden_size = keys.get("moe_intermediate_size")
    moe.shared_expert_ffn_hidden_size = int(keys.get("moe_num_shared_experts", 0)) * int(moe.ffn_hidden_size or 0)
    moe.shared_expert_gate = False
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.input_jitter = "softmax", True, True, 0.0
    moe.topk_norm_min = float(keys.get("moe_norm_min", 1e-12))
    moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor = None, None, "topk_sum", None
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.first_k_dense = 0
    m.rope_interleave = True
    start, end = keys.get("moe_layer_start_index", 1), keys.get("moe_layer_end_index", -1)
    interval = keys.get("moe_layer_interval", 1)
    if not (isinstance(interval, int) and interval >= 1):
        keys.problems.append(f"moe_layer_interval={interval!r} must be an integer >= 1")
        return
    end = m.num_layers - 1 if end == -1 else end
    flags = [int((i + 1) % interval == 0 and start <= i <= end) for i in range(m.num_layers)]
    moe.moe_layer_freq = 1 if all(flags) else flags


def _layer_pattern(flags: list) -> Optional[tuple[int, int, int]]:
    """(start, end, interval) of ERNIE-4.5 that gives the MoE layers ``flags``, None if none does."""
    moe = [i for i, f in enumerate(flags) if f]
    if not moe:
        return None
    for interval in range(1, len(flags) + 1):
        if [bool((i + 1) % interval == 0 and moe[0] <= i <= moe[-1]) for i in range(len(flags))] == list(flags):
            return moe[0], moe[-1], interval
    return None


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(m.qk_norm, "model.qk_norm=true: ERNIE-4.5 has no QK-norm")
    refuse(m.qkv_bias, "model.qkv_bias=true: ERNIE-4.5's use_bias would put biases on o and the MLPs too")
    refuse(not m.rope_interleave, "model.rope_interleave=false: ERNIE-4.5 rotates interleaved pairs")
    refuse(moe.score_function != "softmax" or not moe.pre_softmax,
           f"moe.score_function={moe.score_function}, moe.pre_softmax={str(moe.pre_softmax).lower()}: ERNIE-4.5 "
           f"takes the top-k of the softmax over all experts (pre_softmax)")
    refuse(not moe.expert_bias, "moe.expert_bias=false: ERNIE-4.5's router always has its score correction bias")
    refuse(moe.topk_norm_min is None, "moe.topk_norm_min=null: ERNIE-4.5 always renormalises the top-k "
                                      "(over max(sum, moe_norm_min))")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: ERNIE-4.5 has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: ERNIE-4.5 does not scale probs")
    refuse(moe.shared_expert_gate, "moe.shared_expert_gate=true: ERNIE-4.5's shared experts are not gated")
    refuse(moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size != 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: there are n >= 0 shared "
           f"experts of width moe.ffn_hidden_size={moe.ffn_hidden_size}")
    refuse(_layer_pattern(flags) is None, f"moe layer pattern {[int(f) for f in flags]}: ERNIE-4.5's MoE layers are "
                                          f"every moe_layer_interval-th layer between a start and an end layer")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    start, end, interval = _layer_pattern(flags)
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": m.ffn_hidden_size, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "use_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "moe_num_experts": moe.num_experts, "moe_k": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size,
        "moe_num_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval,
        "moe_norm_min": moe.topk_norm_min, "router_aux_loss_coef": moe.aux_loss_coeff,
    }


FAMILY = Family(
    model_type="ernie4_5_moe", architecture="Ernie4_5_MoeForCausalLM",
    features=frozenset({"rope_interleave", "topk_norm_min"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: (config.model.rope_interleave or config.moe.topk_norm_min is not None
                            or (config.moe.expert_bias and config.moe.score_function == "softmax")),
    export_priority=50,
    moe_names=MoeNames(shared="shared_experts.", shared_gate=False,
                       expert_bias=lambda block: FirstRow(f"{block}moe_statics.e_score_correction_bias")))
