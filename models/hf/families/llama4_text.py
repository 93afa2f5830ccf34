"""Llama-4 text (``Llama4ForCausalLM``, docs/families/llama4.md): top-1 sigmoid routing whose
prob scales the expert's input (``moe.score_on_input``), an ungated shared expert of the
experts' width, MoE on ``moe_layers``, chunked attention on the ``chunked_attention`` layers
(``model.attention_chunk``, ``model.local_attention_layers``), no rotary where
``no_rope_layers`` is 0 (``model.rope_layers``), rotary in interleaved pairs, the unweighted
L2 QK-norm (``model.qk_norm_scope: l2``) and temperature tuning.

Tensors: ``feed_forward.`` holds a dense SwiGLU, or the router, the experts stored fused in
our own layout (``experts.gate_up_proj [E, H, gate|up]``, ``experts.down_proj [E, F, H]``)
and the ungated shared expert."""

from __future__ import annotations

from moe_fold.config import Config, head_dim

from ..sources import Source, Take
from .base import Family, Keys, Refuse, attention_heads, common_sizes, rope_theta, swiglu


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    common_sizes(keys, m, "llama4_text")
    L = m.num_layers
    attention_heads(keys, m)
    m.rope_theta = rope_theta(keys, 500000.0)  # refuses Scout's llama3 rope scaling
    m.rope_interleave = True  # Llama-4 rotates (x0, x1), (x2, x3)... as complex numbers
    m.ffn_hidden_size = keys.get("intermediate_size_mlp")
    m.qkv_bias = False
    m.qk_norm = bool(keys.get("use_qk_norm", True))
    m.qk_norm_scope = "l2"
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("attention_bias", (False,), "attention projections have no biases here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    keys.get("for_llm_compressor", None)  # a quantisation-tooling flag: no effect on the math
    # Rotary on the layers where no_rope_layers is 1 (its default: every no_rope_layer_interval-th layer is NoPE).
    interval = keys.get("no_rope_layer_interval", 4)
    rope = keys.get("no_rope_layers", None) or [int((i + 1) % interval != 0) for i in range(L)]
    if len(rope) != L or any(f not in (0, 1) for f in rope):
        keys.problems.append(f"no_rope_layers={rope!r} must be {L} flags of 0 or 1")
    m.rope_layers = None if all(rope) else [int(f) for f in rope]
    # Chunked attention on the chunked_attention layers (default: the rotary layers).
    layer_types = keys.get("layer_types", None) or ["chunked_attention" if f else "full_attention" for f in rope]
    odd = sorted(set(layer_types) - {"full_attention", "chunked_attention"})
    if odd or len(layer_types) != L:
        keys.problems.append(f"layer_types={layer_types!r} must be {L} of full_attention and chunked_attention")
    chunk = keys.get("attention_chunk_size", None)
    local = [int(t == "chunked_attention") for t in layer_types]
    if any(local) and chunk is None:
        keys.problems.append("layer_types has chunked_attention layers but attention_chunk_size is null")
    if any(local) and chunk is not None:
        m.attention_chunk = int(chunk)
        m.local_attention_layers = None if all(local) else local
    m.attn_temperature_tuning = bool(keys.get("attn_temperature_tuning", True))
    m.attn_temperature_floor = int(keys.get("floor_scale", 8192))
    m.attn_temperature_scale = float(keys.get("attn_scale", 0.1))

    moe.num_experts = keys.get("num_local_experts")
    moe.topk = keys.get("num_experts_per_tok", 1)
    if moe.topk != 1:
        keys.problems.append(f"num_experts_per_tok={moe.topk} is not supported: Llama-4 keeps each expert's sigmoid "
                             f"as it is, moe-fold renormalises sigmoid probs over k > 1 experts")
    moe.ffn_hidden_size = keys.get("intermediate_size")
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = moe.ffn_hidden_size, False
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.score_on_input = "sigmoid", False, False, True
    moe.num_groups, moe.group_topk, moe.group_score = None, None, "topk_sum"
    moe.scaling_factor, moe.first_k_dense = None, 0
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.input_jitter = float(keys.get("router_jitter_noise", 0.0))
    step = keys.get("interleave_moe_layer_step", 1)
    moe_layers = keys.get("moe_layers", None)
    if moe_layers is None:
        moe_layers = list(range(step - 1, L, step)) if isinstance(step, int) and step >= 1 else []
    flags = [int(i in set(moe_layers)) for i in range(L)]
    moe.moe_layer_freq = 1 if all(flags) else flags


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    rope = [1] * m.num_layers if m.rope_layers is None else list(m.rope_layers)
    refuse(moe.score_function != "sigmoid" or moe.topk != 1,
           f"moe.score_function={moe.score_function} with moe.topk={moe.topk}: Llama-4 routes each token to "
           f"its top-1 expert by sigmoid")
    refuse(not moe.score_on_input, "moe.score_on_input=false: Llama-4 scales each expert's input by its prob")
    for name, off in (("expert_bias", False), ("num_groups", None), ("scaling_factor", None),
                      ("shared_expert_gate", False), ("pre_softmax", False)):
        refuse(getattr(moe, name) != off, f"moe.{name}={getattr(moe, name)!r}: Llama-4's router has no such setting")
    refuse(moe.shared_expert_ffn_hidden_size != moe.ffn_hidden_size,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: Llama-4's shared expert is "
           f"as wide as its experts (moe.ffn_hidden_size={moe.ffn_hidden_size})")
    refuse(m.qkv_bias, "model.qkv_bias=true: Llama-4's attention projections have no biases")
    refuse(m.qk_norm and m.qk_norm_scope != "l2",
           f"model.qk_norm_scope={m.qk_norm_scope}: Llama-4's QK-norm is the unweighted L2 norm after rotary")
    refuse(not m.rope_interleave and any(rope), "model.rope_interleave=false: Llama-4 rotates interleaved pairs")
    refuse(m.attention_sinks, "model.attention_sinks=true: Llama-4 has no attention sinks")
    refuse(m.sliding_window != 0, f"model.sliding_window={m.sliding_window}: Llama-4's local layers are chunked")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    rope = [1] * m.num_layers if m.rope_layers is None else list(m.rope_layers)
    local = [1] * m.num_layers if m.local_attention_layers is None else list(m.local_attention_layers)
    chunked = [bool(m.attention_chunk) and f == 1 for f in local]
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": moe.ffn_hidden_size, "intermediate_size_mlp": m.ffn_hidden_size,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "num_local_experts": moe.num_experts, "num_experts_per_tok": 1, "router_aux_loss_coef": moe.aux_loss_coeff,
        "router_jitter_noise": moe.input_jitter, "moe_layers": [i for i, f in enumerate(flags) if f],
        "interleave_moe_layer_step": 1, "use_qk_norm": m.qk_norm, "no_rope_layers": rope,
        "attention_chunk_size": m.attention_chunk or None,
        "layer_types": ["chunked_attention" if c else "full_attention" for c in chunked],
        "attn_temperature_tuning": m.attn_temperature_tuning, "floor_scale": m.attn_temperature_floor,
        "attn_scale": m.attn_temperature_scale,
    }


def _mlp_sources(config: Config, hf: str, ours: str, is_moe: bool, hf_names: frozenset) -> dict[str, Source]:
    """``feed_forward.``: a dense SwiGLU, or the router, the fused experts and the shared expert."""
    hf, ours = f"{hf}feed_forward.", f"{ours}mlp."
    if not is_moe:
        fc1, fc2 = swiglu(hf, "gate_proj", "up_proj", "down_proj", config.model.ffn_hidden_size)
        return {f"{ours}fc1.weight": fc1, f"{ours}fc2.weight": fc2}
    fc1, fc2 = swiglu(f"{hf}shared_expert.", "gate_proj", "up_proj", "down_proj",
                      config.moe.shared_expert_ffn_hidden_size)
    return {f"{ours}router.weight": Take(f"{hf}router.weight"),
            f"{ours}experts.fc1": Take(f"{hf}experts.gate_up_proj"),
            f"{ours}experts.fc2": Take(f"{hf}experts.down_proj"),
            f"{ours}shared_expert.fc1.weight": fc1, f"{ours}shared_expert.fc2.weight": fc2}


FAMILY = Family(
    model_type="llama4_text", architecture="Llama4ForCausalLM",
    # Each attention feature is let through to refusals(), which names what Llama-4 holds.
    features=frozenset({"qk_norm_scope", "rope_interleave", "attention_sinks", "sliding_window", "attention_chunk",
                        "rope_layers", "attn_temperature_tuning", "score_on_input"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: (config.moe.score_on_input or bool(config.model.attention_chunk)
                            or (config.model.qk_norm and config.model.qk_norm_scope == "l2")),
    export_priority=30, mlp_sources=_mlp_sources)
