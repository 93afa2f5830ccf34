"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, docs/families/minimax-m2.md): grouped-query
attention with an RMSNorm over the whole q and k projections (our ``qk_norm_scope:
projection``, as OLMoE) and rotary embeddings on the first ``rotary_dim`` dims of each head
(``partial_rotary_factor``); every layer MoE: sigmoid scores, the expert bias
(``e_score_correction_bias``) added for selection only, the k chosen renormalised; no shared
expert. Its MoE block has Mixtral's names (``block_sparse_moe.``, ``w1``/``w3``/``w2``) with
``block_sparse_moe.e_score_correction_bias``."""

from __future__ import annotations

from moe_fold.config import Config, head_dim

from ..sources import Take
from .base import Family, Keys, MoeNames, Refuse, attention_heads, common_sizes, num_experts, rope_theta


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    common_sizes(keys, m, "minimax_m2", norm_eps=1e-6)
    attention_heads(keys, m, head_dim=128)  # MiniMaxM2Config's default, not hidden/heads
    m.qk_norm, m.qk_norm_scope, m.qkv_bias = True, "projection", False
    params = keys.get("rope_parameters", {})
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    rotary = keys.get("rotary_dim", None)
    from_dim = rotary / m.head_dim if rotary is not None else None
    m.partial_rotary_factor = float(inner if inner is not None else from_dim if from_dim is not None else 1.0)
    if inner is not None and from_dim is not None and inner != from_dim:
        keys.problems.append(f"rotary_dim={rotary} disagrees with rope_parameters.partial_rotary_factor={inner} "
                             f"of head_dim={m.head_dim}")
    m.rope_theta = rope_theta(keys, 5e6, partial_rotary=True)
    keys.must_be("hidden_act", ("silu",), "the experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    # Keys of the original (remote-code) config.json, where they say what transformers computes.
    keys.must_be("use_qk_norm", (True,), "MiniMax-M2 normalises q and k")
    keys.must_be("qk_norm_type", ("per_layer",), "the QK-norm spans the whole q and k projections")
    keys.must_be("scoring_func", ("sigmoid",), "MiniMax-M2 routes with sigmoid scores")
    keys.must_be("use_routing_bias", (True,), "the router always has its score correction bias")
    moe.num_experts = num_experts(keys, "num_local_experts", "num_experts")
    moe.topk = keys.get("num_experts_per_tok")
    moe.ffn_hidden_size = m.ffn_hidden_size = keys.get("intermediate_size")
    moe.moe_layer_freq, moe.first_k_dense = 1, 0
    moe.score_function, moe.pre_softmax, moe.expert_bias = "sigmoid", False, True
    moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor = None, None, "topk_sum", None
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False
    moe.input_jitter = float(keys.get("router_jitter_noise", 0.0))
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    if moe.topk == 1:
        keys.problems.append("num_experts_per_tok=1 is not supported: MiniMax-M2 renormalises the top-k sigmoid "
                             "scores (a weight of 1 for k=1), moe-fold renormalises for k > 1 only")


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(not (m.qk_norm and m.qk_norm_scope == "projection"),
           f"model.qk_norm={str(m.qk_norm).lower()}, model.qk_norm_scope={m.qk_norm_scope}: MiniMax-M2 normalises "
           f"the whole q and k projections")
    refuse(m.qkv_bias, "model.qkv_bias=true: MiniMax-M2 has no q|k|v biases")
    refuse(moe.score_function != "sigmoid", f"moe.score_function={moe.score_function}: MiniMax-M2 routes with "
                                            f"sigmoid scores")
    refuse(not moe.expert_bias, "moe.expert_bias=false: MiniMax-M2's router always has its score correction bias")
    refuse(moe.topk < 2, f"moe.topk={moe.topk}: MiniMax-M2 renormalises the top-k sigmoid scores, which moe-fold "
                         f"does only for k > 1")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: MiniMax-M2 has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: MiniMax-M2 does not scale "
                                           f"probs")
    refuse(moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: MiniMax-M2 has no shared expert")
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every MiniMax-M2 layer is MoE")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": moe.ffn_hidden_size, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "router_aux_loss_coef": moe.aux_loss_coeff, "router_jitter_noise": moe.input_jitter,
    }


FAMILY = Family(
    model_type="minimax_m2", architecture="MiniMaxM2ForCausalLM",
    features=frozenset({"qk_norm_scope", "partial_rotary"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: (config.model.qk_norm and config.model.qk_norm_scope == "projection"
                            and config.moe.score_function == "sigmoid"),
    export_priority=60,
    moe_names=MoeNames(block="block_sparse_moe.", experts=("w1", "w3", "w2"),
                       expert_bias=lambda block: Take(f"{block}e_score_correction_bias")))
