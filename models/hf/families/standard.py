"""What Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE share: standard grouped-query attention with
unscaled rotary on two halves of each head, softmax routing with no groups, bias or scaling,
and (but Mixtral) Qwen's layer pattern: layer ``i`` is MoE when ``(i + 1) %
decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``, a 0/1 ``moe.moe_layer_freq``
list.

Routing (Hugging Face takes top-k of the softmax over all experts, then renormalises the k
probabilities when asked to): a renormalised top-k of the full softmax equals the softmax
over the k chosen logits, our ``moe.pre_softmax: false``; Qwen's ``norm_topk_prob: false``
keeps the top-k of the full softmax as they are, our ``moe.pre_softmax: true``.
Training-only settings map too: ``router_aux_loss_coef`` -> ``moe.aux_loss_coeff``."""

from __future__ import annotations

from typing import Any, Optional

from moe_fold.config import Config, head_dim

from .base import Keys, Refuse, attention_heads, check_window, common_sizes, num_experts, rope_theta

__all__ = ["sizes_from_hf", "softmax_routing_from_hf", "qwen_layers_from_hf", "qwen_moe_layers_from_hf", "no_attention_bias", "refusals", "to_hf", "qwen_to_hf"]


def sizes_from_hf(keys: Keys, config: Config, family: str, *, norm_eps: float, theta: float,
                  qk_norm: bool) -> None:
    """The attention, dense width and routing every one of the four reads alike."""
    m, moe = config.model, config.moe
    common_sizes(keys, m, family, norm_eps=norm_eps)
    attention_heads(keys, m)
    m.rope_theta = rope_theta(keys, theta)
    m.ffn_hidden_size = keys.get("intermediate_size")
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("mlp_bias", (False,), "the MLPs have no biases here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")

    softmax_routing_from_hf(keys, config)
    m.qk_norm, m.qkv_bias = qk_norm, False


def softmax_routing_from_hf(keys: Keys, config: Config) -> None:
    """Softmax top-k routing with no groups, bias or scaling, and no shared expert yet."""
    moe = config.moe
    moe.score_function, moe.num_groups, moe.group_topk, moe.group_score = "softmax", None, None, "topk_sum"
    moe.scaling_factor, moe.expert_bias, moe.first_k_dense = None, False, 0
    moe.topk = keys.get("num_experts_per_tok")
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.input_jitter = 0.0
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False


def qwen_layers_from_hf(keys: Keys, config: Config, *, experts_are_dense_wide: bool) -> None:
    """Qwen's experts, renormalisation and layer pattern, and its sliding window (checked:
    one shorter than the sequence is refused). ``experts_are_dense_wide``: the experts are
    ``intermediate_size`` wide (OLMoE, every layer MoE), not ``moe_intermediate_size``."""
    m = config.model
    qwen_moe_layers_from_hf(keys, config, experts_are_dense_wide=experts_are_dense_wide)
    sliding = bool(keys.get("use_sliding_window", False))
    keys.get("max_window_layers", None)  # which layers slide: moot, any window is checked below
    layer_types = keys.get("layer_types", None)
    if layer_types is not None:
        odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if odd:
            keys.problems.append(f"layer_types has {odd}: only full_attention and sliding_attention are known")
        sliding = sliding and "sliding_attention" in layer_types
    check_window(keys, m.seq_length, sliding_layers=sliding)


def qwen_moe_layers_from_hf(keys: Keys, config: Config, *, experts_are_dense_wide: bool = False) -> None:
    """Qwen's experts, renormalisation (``norm_topk_prob``) and MoE layer pattern
    (``decoder_sparse_step``, ``mlp_only_layers``)."""
    m, moe = config.model, config.moe
    moe.num_experts = num_experts(keys, "num_experts", "num_local_experts")
    moe.ffn_hidden_size = m.ffn_hidden_size if experts_are_dense_wide else keys.get("moe_intermediate_size")
    moe.pre_softmax = not keys.get("norm_topk_prob", False)
    step = keys.get("decoder_sparse_step", 1)
    dense = set(keys.get("mlp_only_layers", []))
    if isinstance(m.num_layers, int) and isinstance(step, int) and step >= 1:
        flags = [int(i not in dense and (moe.num_experts or 0) > 0 and (i + 1) % step == 0)
                 for i in range(m.num_layers)]
        moe.moe_layer_freq = 1 if all(flags) else flags
    else:
        keys.problems.append(f"decoder_sparse_step={step!r} must be an integer >= 1")


def no_attention_bias(keys: Keys) -> None:
    keys.must_be("attention_bias", (False,), "attention projections have no biases here (q|k|v bias is "
                                             "Qwen2-MoE's qkv_bias; the output projection has none)")


def refusals(config: Config, refuse: Refuse, family: str, *, qk_norm: bool, qk_norm_scope: Optional[str] = None,
             qkv_bias_and_shared: bool = False) -> None:
    """What the four cannot hold: ``qk_norm`` (the family always normalises q and k, else
    never), ``qk_norm_scope`` (the one scope it has, None: per head, checked before),
    ``qkv_bias_and_shared`` (q|k|v biases may be on, and the gated shared expert is always
    there: Qwen2-MoE)."""
    m, moe = config.model, config.moe
    refuse(moe.score_function != "softmax", f"moe.score_function={moe.score_function}: Hugging Face {family} routes "
                                            f"with softmax")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: {family} has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: {family} does not scale probs")
    refuse(moe.expert_bias, f"moe.expert_bias=true: {family} has no expert bias")
    refuse(moe.shared_expert_ffn_hidden_size > 0 and not moe.shared_expert_gate,
           "moe.shared_expert_gate=false with a shared expert: Hugging Face's shared expert is always gated")
    refuse(not qk_norm and m.qk_norm, f"model.qk_norm=true: {family} has no QK-norm (Qwen3-MoE and OLMoE have)")
    refuse(qk_norm and not m.qk_norm, f"model.qk_norm=false: {family} always normalises q and k")
    refuse(qk_norm_scope is not None and m.qk_norm and m.qk_norm_scope != qk_norm_scope,
           f"model.qk_norm_scope={m.qk_norm_scope}: OLMoE normalises the whole q and k projections")
    refuse(not qkv_bias_and_shared and m.qkv_bias,
           f"model.qkv_bias=true: {family} has no q|k|v biases (Qwen2-MoE has)")
    refuse(not qkv_bias_and_shared and moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: {family} has no shared expert")
    refuse(qkv_bias_and_shared and moe.shared_expert_ffn_hidden_size == 0,
           "moe.shared_expert_ffn_hidden_size=0: Qwen2-MoE always has a (gated) shared expert")


def to_hf(config: Config, intermediate_size: int) -> dict[str, Any]:
    """The keys the four write alike."""
    m, moe = config.model, config.moe
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "num_experts_per_tok": moe.topk, "router_aux_loss_coef": moe.aux_loss_coeff,
    }


def qwen_to_hf(config: Config, flags: list) -> dict[str, Any]:
    """Qwen's keys: the standard ones, its experts and layer pattern (no sliding window)."""
    moe = config.moe
    hf = to_hf(config, config.model.ffn_hidden_size)
    hf.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
              norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=[i for i, f in enumerate(flags) if not f], use_sliding_window=False)
    return hf
