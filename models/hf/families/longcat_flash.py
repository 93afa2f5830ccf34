"""LongCat-Flash (``LongcatFlashForCausalLM``, docs/families/longcat-flash.md): ``num_layers``
blocks of two attention sublayers and two dense MLPs with a shortcut-connected MoE
(``model.block: shortcut_moe``); multi-head latent attention with a low-rank query, the
LoRA scaling (``model.mla_lora_scale``), latent norms of epsilon 1e-6 whatever
``rms_norm_eps`` is (``model.mla_norm_eps``) and interleaved rotary pairs (over
``head_dim``, which must be ``qk_rope_head_dim``); softmax scores over ``n_routed_experts +
zero_expert_num`` columns, picked with the ``e_score_correction_bias`` (our expert bias),
not renormalised, scaled by ``routed_scaling_factor``; ``zero_expert_num`` zero-computation
experts (``moe.zero_experts``).

Tensors, per layer ``model.layers.{i}.``: ``input_layernorm.{j}``, ``self_attn.{j}.*``,
``post_attention_layernorm.{j}``, ``mlps.{j}.{gate,up,down}_proj`` for sublayer j (our
``sublayers.{j}.*``); the MoE under ``mlp.``: ``router.classifier.weight``,
``router.e_score_correction_bias`` and per expert ``experts.{e}.{gate,up,down}_proj``.
transformers' fused ``gate_up_proj`` has rows for the zero experts too, which it never
reads: a saved checkpoint holds ``experts.{e}.gate_proj``/``up_proj`` for ``e`` in ``[E, E+Z)``;
import skips them and export writes zeros there (:class:`~..sources.Unread`)."""

from __future__ import annotations

from moe_fold.config import Config

from ..sources import Source, Take, Unread
from .base import Family, HFConfigError, Keys, Refuse, experts_sources, mla_sources, rope_to_hf, swiglu, yarn_rope

# transformers builds the latents' RMSNorms with this epsilon, whatever rms_norm_eps is.
LATENT_EPS = 1e-6
_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    m.vocab_size, m.hidden_size = keys.get("vocab_size"), keys.get("hidden_size")
    m.num_layers, m.num_heads = keys.get("num_layers"), keys.get("num_attention_heads")
    if None in (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads):
        raise HFConfigError(keys.problems, "cannot import longcat_flash config")
    m.norm_eps = float(keys.get("rms_norm_eps", 1e-5))
    m.tie_embeddings = bool(keys.get("tie_word_embeddings", False))
    m.init_std = float(keys.get("initializer_range", 0.02))
    kv_heads = keys.get("num_key_value_heads", m.num_heads)
    if kv_heads != m.num_heads:
        keys.problems.append(f"num_key_value_heads={kv_heads} must equal num_attention_heads={m.num_heads}: MLA "
                             f"gives every head its own key and value")
    m.num_kv_heads, m.head_dim, m.qk_norm, m.qkv_bias = m.num_heads, None, False, False
    m.ffn_hidden_size = keys.get("ffn_hidden_size", 12288)
    m.attention, m.rope_interleave = "mla", True
    m.q_lora_rank = keys.get("q_lora_rank", 1536)
    m.kv_lora_rank = keys.get("kv_lora_rank", 512)
    m.qk_nope_head_dim = keys.get("qk_nope_head_dim", 128)
    m.qk_rope_head_dim = keys.get("qk_rope_head_dim", 64)
    m.v_head_dim = keys.get("v_head_dim", 128)
    # transformers' rotary covers head_dim dims (default 64) and rotates qk_rope_head_dim of them.
    for key, expected in (("head_dim", m.qk_rope_head_dim), ("qk_head_dim", m.qk_nope_head_dim + m.qk_rope_head_dim)):
        value = keys.get(key, expected)
        if value != expected:
            keys.problems.append(f"{key}={value} disagrees with qk_nope_head_dim={m.qk_nope_head_dim} and "
                                 f"qk_rope_head_dim={m.qk_rope_head_dim} (expected {expected}): transformers' "
                                 f"rotary would cover other dims than the ones it rotates")
    m.block, m.mla_lora_scale, m.mla_norm_eps = "shortcut_moe", True, LATENT_EPS
    if keys.hf.get("rope_parameters") is None and keys.hf.get("rope_theta") is None:
        keys.hf = {**keys.hf, "rope_theta": 1e7}  # LongcatFlashConfig's default_theta
    yarn_rope(keys, m)
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("attention_bias", (False,), "the MLA projections have no biases here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    keys.must_be("router_bias", (False,), "the router's classifier has no bias here")
    keys.must_be("zero_expert_type", ("identity",), "a zero-computation expert returns its input")
    keys.must_be("mla_scale_q_lora", (True,), "transformers always scales the query latent")
    keys.must_be("mla_scale_kv_lora", (True,), "transformers always scales the key/value latent")
    moe.num_experts = keys.get("n_routed_experts", 512)
    moe.zero_experts = int(keys.get("zero_expert_num", 256) or 0)
    moe.topk = keys.get("moe_topk", 12)
    moe.ffn_hidden_size = keys.get("expert_ffn_hidden_size", 2048)
    moe.moe_layer_freq, moe.first_k_dense = 1, 0
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.input_jitter = "softmax", True, True, 0.0
    moe.num_groups, moe.group_topk, moe.topk_norm_min = None, None, None
    factor = float(keys.get("routed_scaling_factor", 6.0))
    moe.scaling_factor = None if factor == 1.0 else factor
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(m.block != "shortcut_moe", f"model.block={m.block}: LongCat-Flash's blocks are shortcut_moe (two attention "
                                      f"sublayers and a shortcut-connected MoE)")
    refuse(m.attention != "mla" or m.q_lora_rank is None,
           f"model.attention={m.attention}, model.q_lora_rank={m.q_lora_rank}: LongCat-Flash has multi-head latent "
           f"attention with a low-rank query")
    refuse(not m.mla_lora_scale, "model.mla_lora_scale=false: LongCat-Flash always scales the MLA latents")
    eps = m.norm_eps if m.mla_norm_eps is None else m.mla_norm_eps
    refuse(eps != LATENT_EPS, f"model.mla_norm_eps={eps}: transformers' LongCat-Flash latent norms have epsilon "
                              f"{LATENT_EPS}")
    refuse(not m.rope_interleave, "model.rope_interleave=false: LongCat-Flash rotates interleaved pairs")
    refuse(moe.score_function != "softmax" or not moe.pre_softmax,
           f"moe.score_function={moe.score_function}, moe.pre_softmax={str(moe.pre_softmax).lower()}: LongCat-Flash "
           f"takes the top-k of the softmax over every expert")
    refuse(not moe.expert_bias, "moe.expert_bias=false: the router always has its score correction bias")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: LongCat-Flash has no group-limited routing")
    refuse(moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: LongCat-Flash has no shared expert")


def to_hf(config: Config, flags: list) -> dict:
    m, moe = config.model, config.moe
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads, "ffn_hidden_size": m.ffn_hidden_size,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "head_dim": m.qk_rope_head_dim,
        "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False, "rope_parameters": rope_to_hf(m),
        "n_routed_experts": moe.num_experts, "zero_expert_num": moe.zero_experts, "moe_topk": moe.topk,
        "expert_ffn_hidden_size": moe.ffn_hidden_size,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
    }


def layer_sources(config: Config, layer: int, hf: str, ours: str, hf_names: frozenset) -> dict[str, Source]:
    """Sublayer j's norms, MLA and dense MLP, then the MoE (router, expert bias, experts)."""
    m, moe = config.model, config.moe
    out: dict[str, Source] = {}
    for j in (0, 1):
        sub = f"{ours}sublayers.{j}."
        out[f"{sub}attn_norm.weight"] = Take(f"{hf}input_layernorm.{j}.weight")
        out[f"{sub}mlp_norm.weight"] = Take(f"{hf}post_attention_layernorm.{j}.weight")
        out.update(mla_sources(config, f"{hf}self_attn.{j}.", f"{sub}attn."))
        out[f"{sub}mlp.fc1.weight"], out[f"{sub}mlp.fc2.weight"] = swiglu(
            f"{hf}mlps.{j}.", "gate_proj", "up_proj", "down_proj", m.ffn_hidden_size)
    block = f"{hf}mlp."
    out[f"{ours}mlp.router.weight"] = Take(f"{block}router.classifier.weight")
    out[f"{ours}mlp.router.expert_bias"] = Take(f"{block}router.e_score_correction_bias")
    fc1, fc2 = experts_sources(block, _EXPERTS, moe.num_experts, moe.ffn_hidden_size, fused=False)
    unread = tuple((f"{block}experts.{e}.{proj}.weight", (moe.ffn_hidden_size, m.hidden_size))
                   for e in range(moe.num_experts, moe.num_experts + moe.zero_experts) for proj in _EXPERTS[:2])
    out[f"{ours}mlp.experts.fc1"], out[f"{ours}mlp.experts.fc2"] = Unread(fc1, unread), fc2
    return out


FAMILY = Family(
    model_type="longcat_flash", architecture="LongcatFlashForCausalLM",
    features=frozenset({"mla", "rope_interleave", "yarn", "zero_experts", "shortcut_moe", "mla_lora_scale",
                        "mla_norm_eps"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.block == "shortcut_moe", export_priority=3,
    layer_sources=layer_sources)
