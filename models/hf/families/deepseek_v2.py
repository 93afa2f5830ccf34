"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``, docs/families/deepseek-v2.md):
DeepSeek-V3's MLA with rotary pairs always interleaved (DeepseekV2 rotates them as complex
numbers); softmax over all experts, the top-k of those probabilities as they are (our
``pre_softmax: true``), times ``routed_scaling_factor``; ``greedy`` top-k, or
``group_limited_greedy``: the ``topk_group`` groups with the highest single score first
(``moe.group_score: max``); ungated shared experts; the first layers dense. Its MoE block
is DeepSeek-V3's without the score correction bias."""

from __future__ import annotations

from moe_fold.config import Config, group_ranked_scores

from .base import Family, Keys, Refuse, rope_to_hf
from .deepseek_common import (MOE_NAMES, check_group_reach, dense_first_refusal, latent_eps_refusal, mla_from_hf,
                              mla_tail_to_hf, mla_to_hf, shared_experts_refusal)


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    mla_from_hf(keys, config, "deepseek_v2")
    m.rope_interleave = True
    keys.must_be("rope_interleave", (True,), "DeepSeek-V2 always rotates interleaved pairs")
    keys.must_be("mlp_bias", (False,), "the MLPs have no biases here")
    keys.must_be("scoring_func", ("softmax",), "DeepSeek-V2 routes with a softmax over all experts")
    keys.must_be("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE")
    # transformers' DeepseekV2 never renormalises the top-k (it ignores norm_topk_prob), DeepSeek's
    # own code does when it is true: only false means the same in both.
    keys.must_be("norm_topk_prob", (False,), "transformers' DeepseekV2 ignores it (the top-k softmax "
                                             "probabilities are never renormalised) while DeepSeek's code "
                                             "renormalises; only false computes the same in both")
    m.mtp_num_layers = 0
    moe.num_experts = keys.get("n_routed_experts")
    moe.ffn_hidden_size = keys.get("moe_intermediate_size")
    moe.topk = keys.get("num_experts_per_tok")
    moe.moe_layer_freq = 1
    moe.first_k_dense = keys.get("first_k_dense_replace", 0)
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.input_jitter = "softmax", True, False, 0.0
    factor = float(keys.get("routed_scaling_factor", 1.0))
    moe.scaling_factor = None if factor == 1.0 else factor
    moe.shared_expert_ffn_hidden_size = int(keys.get("n_shared_experts", 0)) * int(moe.ffn_hidden_size or 0)
    moe.shared_expert_gate = False
    method = keys.get("topk_method", "greedy")
    groups, group_topk = keys.get("n_group", 1), keys.get("topk_group", 1)
    moe.group_score = "max"
    moe.num_groups, moe.group_topk = None, None
    if method == "group_limited_greedy" and groups != 1:
        moe.num_groups, moe.group_topk = groups, group_topk
        check_group_reach(keys, moe)
    elif method not in ("greedy", "group_limited_greedy"):
        keys.problems.append(f"topk_method={method!r} is not supported for deepseek_v2: 'greedy' or "
                             f"'group_limited_greedy'")


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(m.attention != "mla", "model.attention=mha: DeepSeek-V2 has multi-head latent attention")
    latent_eps_refusal(config, refuse, "deepseek_v2")
    refuse(not m.rope_interleave, "model.rope_interleave=false: DeepSeek-V2 rotates interleaved pairs")
    refuse(moe.score_function != "softmax", f"moe.score_function={moe.score_function}: DeepSeek-V2 routes with a "
                                            f"softmax over all experts")
    refuse(not moe.pre_softmax, "moe.pre_softmax=false: DeepSeek-V2 keeps the top-k of the softmax over all "
                                "experts as they are (transformers never renormalises them)")
    refuse(moe.expert_bias, "moe.expert_bias=true: DeepSeek-V2's router has no expert bias")
    shared_experts_refusal(config, refuse)
    dense_first_refusal(config, flags, refuse)
    ranked = None if moe.num_groups is None else group_ranked_scores(moe.group_score, moe.topk, moe.group_topk)
    refuse(ranked not in (None, 1),
           f"moe.group_score={moe.group_score} with moe.topk={moe.topk} and moe.group_topk={moe.group_topk}: "
           f"DeepSeek-V2 ranks a group by its best score, this model by the sum of its best {ranked} "
           f"(group_score=max, or topk_sum with topk = group_topk, can be exported)")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    return {
        **mla_to_hf(config), **mla_tail_to_hf(config), "mlp_bias": False, "rope_parameters": rope_to_hf(m),
        "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "first_k_dense_replace": moe.first_k_dense, "norm_topk_prob": False,
        "topk_method": "greedy" if moe.num_groups is None else "group_limited_greedy",
        "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
    }


FAMILY = Family(
    model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM",
    features=frozenset({"mla", "mla_norm_eps", "rope_interleave", "yarn"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.attention == "mla" and config.moe.score_function == "softmax",
    export_priority=10, moe_names=MOE_NAMES)
