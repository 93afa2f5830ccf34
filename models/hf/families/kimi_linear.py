"""Kimi-Linear (``KimiLinearForCausalLM``, docs/families/kimi-linear.md): KDA layers
(``linear_attention``, our ``kda``) and multi-head latent attention without rotary
embeddings (``full_attention``: MLA with NoPE, our ``mla`` with ``model.rope_layers`` all 0;
``qk_rope_head_dim`` dims of the shared key still exist, unrotated), in ``layer_types`` or
the original checkpoint's ``linear_attn_config`` (``kda_layers``/``full_attn_layers``,
1-based); DeepSeek-V3's MoE layers (sigmoid scores with the score correction bias, the
top-k renormalised and scaled by ``routed_scaling_factor``, group-limited when
``num_expert_group`` > 1, ungated shared experts, the first ``first_k_dense_replace`` layers
dense), under Kimi's key names (``num_experts``, ``num_experts_per_token``,
``num_shared_experts``, ``moe_renormalize``, ``num_expert_group``; transformers' own
attribute names are read too).

Tensors (the checkpoint's names, which transformers converts on load): a KDA layer's
``self_attn.{q,k,v,b}_proj`` are our ``attn.in_proj`` (rows q|k|v|b); ``f_a_proj`` and
``g_a_proj`` our ``attn.gates_down``; ``f_b_proj`` our ``attn.decay_up``, ``g_b_proj`` our
``attn.gate_up``; ``{q,k,v}_conv1d.weight [C, 1, K]`` our ``attn.conv_weight``; ``A_log
[1, 1, heads, 1]`` ours ``[heads]``; ``dt_bias``, ``o_norm`` and ``o_proj``. The MoE block is
``block_sparse_moe.`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from moe_fold.config import Config, layer_mixer

from ..sources import Cat, Source, Squeezed, Take
from .base import Family, Keys, MoeNames, Refuse, attention_sources, common_sizes, mlp_sources, swiglu
from .deepseek_common import deepseek_moe_from_hf, deepseek_moe_refusals, deepseek_moe_to_hf

# Hugging Face's layer type -> ours
LAYER_TYPES = {"linear_attention": "kda", "full_attention": "attention"}
_TO_HF = {ours: theirs for theirs, ours in LAYER_TYPES.items()}

# Kimi's config.json name -> DeepSeek-V3's, which deepseek_moe_from_hf reads; transformers'
# attribute names for the same settings are the DeepSeek ones already.
_MOE_KEYS = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
             "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
             "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group"}

# transformers' KimiLinearConfig defaults of the MoE keys (under DeepSeek-V3's names).
_MOE_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
                 "moe_intermediate_size": 1024, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
                 "num_nextn_predict_layers": 0}

# linear_attn_config's keys -> (transformers' top-level key, its default); kda_layers and
# full_attn_layers apart
_LINEAR_ATTN = {"num_heads": ("linear_num_heads", 32), "head_dim": ("linear_head_dim", 128),
                "short_conv_kernel_size": ("linear_conv_kernel_dim", 4)}

MOE_NAMES = MoeNames(block="block_sparse_moe.", experts=("w1", "w3", "w2"), shared="shared_experts.",
                     shared_gate=False, expert_bias=lambda block: Take(f"{block}gate.e_score_correction_bias"))
_moe_sources = mlp_sources(MOE_NAMES)


def _layer_types(keys: Keys, num_layers: int, linear: dict) -> list:
    """Each layer's type from ``layer_types``, else ``linear_attn_config``'s 1-based lists,
    else transformers' default (full attention on every fourth layer from layer 4)."""
    types = keys.get("layer_types", None)
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * num_layers
        for kind, layers in (("full_attention", linear["full_attn_layers"]), ("linear_attention", linear["kda_layers"])):
            for layer in layers:
                if not 1 <= layer <= num_layers:
                    keys.problems.append(f"linear_attn_config names layer {layer}: layers are 1 to {num_layers}")
                    return []
                types[layer - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return types


def from_hf(keys: Keys, config: Config) -> None:
    m = config.model
    common_sizes(keys, m, "kimi_linear", norm_eps=1e-5)
    m.ffn_hidden_size = keys.get("intermediate_size")
    # MLA: every head its own key and value; no rotary (transformers' Kimi-Linear attention is
    # NoPE whatever mla_use_nope says, and so is the released model).
    kv_heads = keys.get("num_key_value_heads", m.num_heads)
    if kv_heads != m.num_heads:
        keys.problems.append(f"num_key_value_heads={kv_heads} must equal num_attention_heads={m.num_heads}: MLA "
                             f"gives every head its own key and value")
    m.num_kv_heads, m.head_dim, m.attention = m.num_heads, None, "mla"
    m.q_lora_rank = keys.get("q_lora_rank", None)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        setattr(m, name, keys.get(name))
    m.rope_layers = [0] * m.num_layers
    m.mla_norm_eps = 1e-6  # transformers' latent norms keep their default epsilon
    m.qk_norm, m.qkv_bias = False, False
    keys.must_be("mla_use_nope", (True,), "Kimi-Linear's MLA has no rotary embeddings (NoPE)")
    # transformers derives head_dim and qk_head_dim from the MLA sizes; the rotary keys and the
    # context length change nothing under NoPE.
    for unused in ("head_dim", "qk_head_dim", "rope_theta", "rope_parameters", "rope_scaling", "model_max_length"):
        keys.get(unused, None)
    keys.must_be("tie_word_embeddings", (False,), "transformers' Kimi-Linear never ties the head to the embedding")
    keys.must_be("hidden_act", ("silu",), "the MLPs, experts and the KDA conv use SiLU")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("attention_bias", (False,), "Kimi-Linear's attention projections have no biases here")
    keys.must_be("pretraining_tp", (1,), "pretraining_tp splits the linears' math differently")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    keys.must_be("moe_router_activation_func", ("sigmoid",), "Kimi-Linear routes with sigmoid scores")
    keys.must_be("moe_layer_freq", (1,), "every layer after the dense ones is MoE")
    keys.must_be("num_nextn_predict_layers", (0,), "transformers' Kimi-Linear has no multi-token prediction")
    # KDA: one head count and one width for q, k and v.
    linear = dict(keys.get("linear_attn_config", {}) or {})
    extra = sorted(set(linear) - set(_LINEAR_ATTN) - {"kda_layers", "full_attn_layers"})
    if extra:
        keys.problems.append(f"linear_attn_config sets {', '.join(extra)}, which transformers' KDA does not have")
    heads, width, kernel = (int(linear.get(theirs, keys.get(*top))) for theirs, top in _LINEAR_ATTN.items())
    m.linear_num_key_heads = m.linear_num_value_heads = heads
    m.linear_key_head_dim = m.linear_value_head_dim = width
    m.linear_conv_kernel = kernel
    types = _layer_types(keys, m.num_layers, linear)
    odd = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if odd:
        keys.problems.append(f"layer_types has {odd}: only linear_attention (KDA) and full_attention (MLA) are known")
    elif types and len(types) != m.num_layers:
        keys.problems.append(f"layer_types has {len(types)} entries; num_hidden_layers={m.num_layers} needs one each")
    elif types:
        m.layer_types = [LAYER_TYPES[t] for t in types]
    _moe_from_hf(keys, config)


def _moe_from_hf(keys: Keys, config: Config) -> None:
    """DeepSeek-V3's MoE layers under Kimi's names; the dense layers from ``mlp_layer_types``
    (dense, then sparse) or ``first_k_dense_replace`` (transformers' default 1)."""
    renamed = {deepseek: keys.get(kimi) for kimi, deepseek in _MOE_KEYS.items() if keys.get(kimi, None) is not None}
    keys.hf = {**_MOE_DEFAULTS, **keys.hf, **renamed}
    deepseek_moe_from_hf(keys, config)
    kinds = keys.get("mlp_layer_types", None)
    if kinds is not None:
        k = list(kinds).index("sparse") if "sparse" in kinds else len(kinds)
        if list(kinds) != ["dense"] * k + ["sparse"] * (len(kinds) - k) or len(kinds) != config.model.num_layers:
            keys.problems.append(f"mlp_layer_types={kinds} is not supported: {config.model.num_layers} entries, "
                                 f"dense layers first and every later layer sparse")
        config.moe.first_k_dense = k


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m = config.model
    types = m.layer_types or ["attention"] * m.num_layers
    refuse(m.attention != "mla", f"model.attention={m.attention}: kimi_linear's full-attention layers are MLA")
    refuse("gated_deltanet" in types, f"model.layer_types={types}: kimi_linear's linear layers are KDA, not "
                                      f"Gated DeltaNet")
    refuse(m.rope_layers is None or any(m.rope_layers),
           f"model.rope_layers={m.rope_layers}: kimi_linear's MLA has no rotary embeddings (NoPE: every flag 0)")
    eps = m.norm_eps if m.mla_norm_eps is None else m.mla_norm_eps
    refuse(eps != 1e-6, f"model.mla_norm_eps={m.mla_norm_eps} (model.norm_eps={m.norm_eps}): kimi_linear's MLA "
                        f"latent norms have epsilon 1e-6")
    refuse(m.tie_embeddings, "model.tie_embeddings=true: transformers' Kimi-Linear never ties the head to the "
                             "embedding")
    refuse(m.mtp_num_layers > 0, f"model.mtp_num_layers={m.mtp_num_layers}: kimi_linear has no multi-token "
                                 f"prediction")
    deepseek_moe_refusals(config, flags, refuse)


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    types = m.layer_types or ["attention"] * m.num_layers
    deepseek = deepseek_moe_to_hf(config)
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "mla_use_nope": True,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "model_max_length": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False,
        "layer_types": [_TO_HF[t] for t in types],
        "linear_num_heads": m.linear_num_key_heads, "linear_head_dim": m.linear_key_head_dim,
        "linear_conv_kernel_dim": m.linear_conv_kernel,
        "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "num_experts": moe.num_experts, "num_experts_per_token": moe.topk,
        "num_shared_experts": deepseek["n_shared_experts"], "moe_renormalize": True,
        "num_expert_group": deepseek["n_group"], "topk_group": deepseek["topk_group"],
        "routed_scaling_factor": deepseek["routed_scaling_factor"],
        "first_k_dense_replace": moe.first_k_dense,
        "mlp_layer_types": ["sparse" if flag else "dense" for flag in flags],
        # KimiLinearConfig's defaults are Kimi's tokenizer's ids, past a smaller vocabulary (its
        # embedding refuses such a padding id); the tokenizer's own go to generation_config.json.
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def block_sources(config: Config, hf: str, ours: str, is_moe: bool, hf_names: frozenset) -> dict[str, Source]:
    """A layer's MoE block, or its dense MLP where the checkpoint holds it (``mlp.``) or
    where transformers saves it (``block_sparse_moe.``, also what export writes)."""
    if is_moe:
        return _moe_sources(config, hf, ours, is_moe, hf_names)
    block = f"{hf}mlp." if f"{hf}mlp.gate_proj.weight" in hf_names else f"{hf}block_sparse_moe."
    fc1, fc2 = swiglu(block, "gate_proj", "up_proj", "down_proj", config.model.ffn_hidden_size)
    return {f"{ours}mlp.fc1.weight": fc1, f"{ours}mlp.fc2.weight": fc2}


def mixer_sources(config: Config, layer: int, hf: str, ours: str) -> dict[str, Source]:
    """A KDA layer's tensors (see the module's docstring); MLA layers are the standard ones."""
    m = config.model
    if layer_mixer(m, layer) != "kda":
        return attention_sources(config, layer, hf, ours)
    width, d = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_key_head_dim
    attn = f"{hf}self_attn."
    return {
        f"{ours}attn.in_proj.weight": Cat(0, tuple(Take(f"{attn}{p}_proj.weight") for p in "qkvb"),
                                          (width, width, width, m.linear_num_key_heads)),
        f"{ours}attn.gates_down.weight": Cat(0, (Take(f"{attn}f_a_proj.weight"), Take(f"{attn}g_a_proj.weight")),
                                             (d, d)),
        f"{ours}attn.decay_up.weight": Take(f"{attn}f_b_proj.weight"),
        f"{ours}attn.gate_up.weight": Take(f"{attn}g_b_proj.weight"),
        f"{ours}attn.conv_weight": Cat(0, tuple(Squeezed(f"{attn}{p}_conv1d.weight", 1) for p in "qkv"),
                                       (width, width, width)),
        f"{ours}attn.A_log": Squeezed(f"{attn}A_log", (0, 1, 3)),
        f"{ours}attn.dt_bias": Take(f"{attn}dt_bias"),
        f"{ours}attn.norm_weight": Take(f"{attn}o_norm.weight"),
        f"{ours}attn.out_proj.weight": Take(f"{attn}o_proj.weight"),
    }


FAMILY = Family(
    model_type="kimi_linear", architecture="KimiLinearForCausalLM",
    features=frozenset({"mla", "mla_norm_eps", "layer_types", "rope_layers"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.layer_types is not None and "kda" in config.model.layer_types,
    export_priority=4, moe_names=MOE_NAMES, mlp_sources=block_sources, mixer_sources=mixer_sources)
