"""What DeepSeek-V2, DeepSeek-V3 and GLM-4.5 share, read and written once: multi-head latent
attention's sizes and rotary (V2 and V3), group-limited routing's reach, DeepSeek-V3's MoE
layers and MTP (which GLM-4.5 shares), and their MoE block's tensor names; and what
DeepSeek-V3.2 and GLM-5 share: DeepSeek-V3's model with DSA's lightning indexer."""

from __future__ import annotations

from moe_fold.config import Config, group_ranked_scores

from ..sources import Source, Take
from .base import Keys, MoeNames, Refuse, attention_sources, common_sizes, rope_to_hf, yarn_rope

__all__ = ["mla_from_hf", "mla_to_hf", "mla_tail_to_hf", "check_group_reach", "deepseek_moe_from_hf",
           "deepseek_moe_refusals", "deepseek_moe_to_hf", "shared_experts_refusal", "dense_first_refusal", "MOE_NAMES",
           "MOE_NAMES_BIASED", "latent_eps_refusal", "dsa_from_hf", "dsa_refusals", "dsa_to_hf", "dsa_mixer_sources"]

# The MoE block: ungated shared experts ``mlp.shared_experts.``; V3 and GLM-4.5 add the
# router's score correction bias (our expert bias, a buffer).
MOE_NAMES = MoeNames(shared="shared_experts.", shared_gate=False)
MOE_NAMES_BIASED = MoeNames(shared="shared_experts.", shared_gate=False,
                            expert_bias=lambda block: Take(f"{block}gate.e_score_correction_bias"))


def mla_from_hf(keys: Keys, config: Config, family: str) -> None:
    """The sizes and rotary embeddings of multi-head latent attention (DeepSeek-V2 and -V3)."""
    m = config.model
    common_sizes(keys, m, family, norm_eps=1e-6)
    kv_heads = keys.get("num_key_value_heads", m.num_heads)
    if kv_heads != m.num_heads:
        keys.problems.append(f"num_key_value_heads={kv_heads} must equal num_attention_heads={m.num_heads}: MLA "
                             f"gives every head its own key and value")
    m.num_kv_heads, m.head_dim = m.num_heads, None
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.qk_norm, m.qkv_bias = False, False
    m.attention = "mla"
    m.mla_norm_eps = 1e-6  # transformers' latent norms keep their default epsilon
    m.q_lora_rank = keys.get("q_lora_rank", None)
    m.kv_lora_rank = keys.get("kv_lora_rank")
    m.qk_nope_head_dim = keys.get("qk_nope_head_dim")
    m.qk_rope_head_dim = keys.get("qk_rope_head_dim")
    m.v_head_dim = keys.get("v_head_dim")
    for key, expected in (("head_dim", m.qk_rope_head_dim),
                          ("qk_head_dim", (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0))):
        value = keys.get(key, None)
        if value is not None and value != expected:
            keys.problems.append(f"{key}={value} disagrees with qk_nope_head_dim={m.qk_nope_head_dim} and "
                                 f"qk_rope_head_dim={m.qk_rope_head_dim} (expected {expected})")
    yarn_rope(keys, m)
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("attention_bias", (False,), "the MLA projections have no biases here")
    keys.must_be("pretraining_tp", (1,), "pretraining_tp splits the linears' math differently")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    # Keys of the original (remote-code) config.json.
    keys.get("auto_map", None)
    keys.get("ep_size", None)  # the inference expert-parallel size: no effect on the math
    alpha = keys.get("aux_loss_alpha", None)
    if alpha is not None:
        per_sequence = bool(keys.get("seq_aux", True))
        moe = config.moe
        moe.seq_aux_loss_coeff, moe.aux_loss_coeff = (float(alpha), 0.0) if per_sequence else (0.0, float(alpha))


def mla_to_hf(config: Config) -> dict:
    """The ``config.json`` keys of an MLA model's sizes, attention and rotary (default or YaRN)."""
    m = config.model
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
    }


def mla_tail_to_hf(config: Config) -> dict:
    """The keys after the attention sizes that every MLA export writes alike."""
    m = config.model
    return {"hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
            "attention_bias": False}


def check_group_reach(keys: Keys, moe) -> None:
    """Group-limited top-k must find its k experts in the selected groups: transformers
    would fill the rest with experts of the excluded groups."""
    groups, group_topk = moe.num_groups, moe.group_topk
    experts = moe.num_experts or 0
    reachable = (group_topk or 0) * (experts // groups)
    if experts and groups and moe.topk is not None and moe.topk > reachable:
        keys.problems.append(f"num_experts_per_tok={moe.topk} with topk_group={group_topk} is not supported: "
                             f"the {group_topk} selected groups hold {reachable} experts (n_routed_experts/"
                             f"n_group={experts // groups} each), and transformers would fill the rest with "
                             f"experts of the excluded groups")


def deepseek_moe_from_hf(keys: Keys, config: Config) -> None:
    """DeepSeek-V3's MoE layers, which GLM-4.5 shares: sigmoid routing with the score
    correction bias, group-limited top-k, shared experts, the first layers dense; and
    its multi-token prediction depths (``num_nextn_predict_layers``)."""
    m, moe = config.model, config.moe
    m.mtp_num_layers = int(keys.get("num_nextn_predict_layers", 0) or 0)
    moe.num_experts = keys.get("n_routed_experts")
    moe.ffn_hidden_size = keys.get("moe_intermediate_size")
    moe.topk = keys.get("num_experts_per_tok")
    moe.moe_layer_freq = 1
    moe.first_k_dense = keys.get("first_k_dense_replace", 0)
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.input_jitter = "sigmoid", False, True, 0.0
    factor = float(keys.get("routed_scaling_factor", 1.0))
    moe.scaling_factor = None if factor == 1.0 else factor
    shared = keys.get("n_shared_experts", 0)
    moe.shared_expert_ffn_hidden_size = int(shared) * int(moe.ffn_hidden_size or 0)
    moe.shared_expert_gate = False
    if not keys.get("norm_topk_prob", True) or moe.topk == 1:
        keys.problems.append(f"norm_topk_prob={keys.get('norm_topk_prob', True)} with num_experts_per_tok="
                             f"{moe.topk} is not supported: sigmoid top-k probabilities are renormalised over "
                             f"k > 1 experts here (Megatron-Core's rule)")
    groups, group_topk = keys.get("n_group", 1), keys.get("topk_group", 1)
    # transformers and DeepSeek's reference rank a group by the sum of its best 2 scores
    # (on the biased scores), whatever num_experts_per_tok is.
    moe.group_score = "top2_sum"
    if groups == 1:
        moe.num_groups, moe.group_topk = None, None
    else:
        moe.num_groups, moe.group_topk = groups, group_topk
        check_group_reach(keys, moe)


def shared_experts_refusal(config: Config, refuse: Refuse) -> None:
    moe = config.moe
    refuse(moe.shared_expert_gate, "moe.shared_expert_gate=true: the shared experts are not gated")
    refuse(moe.shared_expert_ffn_hidden_size == 0 or moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size != 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: there are n >= 1 shared "
           f"experts of width moe.ffn_hidden_size={moe.ffn_hidden_size}")


def dense_first_refusal(config: Config, flags: list, refuse: Refuse) -> None:
    k = config.moe.first_k_dense
    refuse(flags != [i >= k for i in range(config.model.num_layers)],
           f"moe layer pattern {[int(f) for f in flags]}: the first first_k_dense={k} layers are dense and every "
           f"later layer MoE")


def deepseek_moe_refusals(config: Config, flags: list, refuse: Refuse) -> None:
    """What DeepSeek-V3's and GLM-4.5's MoE layers cannot hold."""
    moe = config.moe
    refuse(moe.score_function != "sigmoid", f"moe.score_function={moe.score_function}: DeepSeek-V3 and GLM-4.5 "
                                            f"route with sigmoid scores")
    refuse(not moe.expert_bias, "moe.expert_bias=false: the router always has its score correction bias")
    shared_experts_refusal(config, refuse)
    dense_first_refusal(config, flags, refuse)
    refuse(moe.topk < 2, f"moe.topk={moe.topk}: the top-k sigmoid probabilities are renormalised, which "
                         f"moe-fold does only for k > 1")
    ranked = None if moe.num_groups is None else group_ranked_scores(moe.group_score, moe.topk, moe.group_topk)
    refuse(ranked not in (None, 2),
           f"moe.group_score={moe.group_score} with moe.topk={moe.topk} and moe.group_topk={moe.group_topk}: "
           f"DeepSeek-V3 and GLM-4.5 rank a group by the sum of its best 2 scores, this model by its best "
           f"{ranked} (group_score=top2_sum, or topk_sum with topk = 2 * group_topk, can be exported)")


def deepseek_moe_to_hf(config: Config) -> dict:
    """The config.json keys of DeepSeek-V3's MoE layers and MTP (GLM-4.5's too)."""
    m, moe = config.model, config.moe
    return {
        "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "first_k_dense_replace": moe.first_k_dense, "norm_topk_prob": True,
        "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


# --------------------------------------------------------------------------- DSA (DeepSeek-V3.2, GLM-5)

# Our indexer parameter (under ``attn.indexer.``) -> its tensor (under ``self_attn.indexer.``).
_INDEXER = {"wq.weight": "wq_b.weight", "wk.weight": "wk.weight", "k_norm.weight": "k_norm.weight",
            "k_norm.bias": "k_norm.bias", "weights_proj.weight": "weights_proj.weight"}


def dsa_from_hf(keys: Keys, config: Config, family: str) -> None:
    """DeepSeek-V3.2's model, which GLM-5's extends: DeepSeek-V3's MLA (always a query latent
    and interleaved rotary pairs) and MoE layers, and a lightning indexer on every layer
    (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""
    m = config.model
    mla_from_hf(keys, config, family)
    if m.q_lora_rank is None:
        keys.problems.append(f"q_lora_rank is missing (required for {family}: the indexer reads the query latent)")
    m.rope_interleave = True  # transformers' DSA attention rotates MLA's interleaved pairs
    deepseek_moe_from_hf(keys, config)
    keys.must_be("mlp_bias", (False,), "the MLPs have no biases here")
    k = config.moe.first_k_dense
    mlp_types = keys.get("mlp_layer_types", None)
    pattern = ["dense" if i < k else "sparse" for i in range(m.num_layers)]
    if mlp_types is not None and list(mlp_types) != pattern:
        keys.problems.append(f"mlp_layer_types={mlp_types} is not supported: the first first_k_dense_replace={k} "
                             f"layers are dense and every later layer sparse here")
    types = keys.get("layer_types", None)
    if types is not None and set(types) != {"indexed_attention"}:
        keys.problems.append(f"layer_types={types}: every layer of {family} is indexed_attention here")
    m.dsa, m.indexer_types = True, None
    m.index_n_heads = int(keys.get("index_n_heads"))
    m.index_head_dim = int(keys.get("index_head_dim"))
    m.index_topk = int(keys.get("index_topk"))


def latent_eps_refusal(config: Config, refuse: Refuse, family: str) -> None:
    """transformers' DeepSeek-style MLA builds its latent norms with their default epsilon,
    1e-6, whatever ``rms_norm_eps`` is."""
    m = config.model
    eps = m.norm_eps if m.mla_norm_eps is None else m.mla_norm_eps
    refuse(eps != 1e-6, f"model.mla_norm_eps={m.mla_norm_eps} (model.norm_eps={m.norm_eps}): {family}'s latent "
                        f"norms have epsilon 1e-6")


def dsa_refusals(config: Config, flags: list, refuse: Refuse, family: str, interleave: bool) -> None:
    """What DeepSeek-V3.2 and GLM-5 cannot hold (``interleave``: the family's indexer rotary)."""
    m = config.model
    refuse(not m.dsa, f"model.dsa=false: {family}'s attention is DSA")
    refuse(m.q_lora_rank is None, f"model.q_lora_rank=null: {family}'s query is low-rank")
    latent_eps_refusal(config, refuse, family)
    refuse(not m.rope_interleave, f"model.rope_interleave=false: {family}'s MLA rotates interleaved pairs")
    refuse(m.index_rope_interleave != interleave,
           f"model.index_rope_interleave={str(m.index_rope_interleave).lower()}: {family}'s indexer rotates "
           f"{'interleaved pairs' if interleave else 'two halves'}")
    deepseek_moe_refusals(config, flags, refuse)


def dsa_to_hf(config: Config) -> dict:
    """The ``config.json`` keys DeepSeek-V3.2 and GLM-5 write alike."""
    m = config.model
    hf = {**mla_to_hf(config), **mla_tail_to_hf(config), "rope_parameters": rope_to_hf(m),
          **deepseek_moe_to_hf(config), "index_n_heads": m.index_n_heads, "index_head_dim": m.index_head_dim,
          "index_topk": m.index_topk,
          "mlp_layer_types": ["dense" if i < config.moe.first_k_dense else "sparse" for i in range(m.num_layers)]}
    hf.pop("num_nextn_predict_layers")  # transformers' DSA models hold no MTP depths
    return hf


def dsa_mixer_sources(config: Config, layer: int, hf: str, ours: str) -> dict[str, Source]:
    """MLA's tensors and, on a layer with an indexer, the indexer's."""
    out = attention_sources(config, layer, hf, ours)
    types = config.model.indexer_types
    if types is None or layer >= len(types) or types[layer] == "full":
        out.update({f"{ours}attn.indexer.{name}": Take(f"{hf}self_attn.indexer.{theirs}")
                    for name, theirs in _INDEXER.items()})
    return out
