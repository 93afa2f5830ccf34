"""Qwen3-Next (``Qwen3NextForCausalLM``, docs/families/qwen3-next.md): Gated DeltaNet layers
(``linear_attention``) and gated full attention (``full_attention``) in ``layer_types``;
zero-centred RMSNorms; a per-head QK-norm and rotary on the first ``partial_rotary_factor``
of each head; Qwen's MoE layer pattern with a gated shared expert.

Its tensors differ from ours in order only:

- ``linear_attn.in_proj_qkvz`` holds, for each key head h, ``q_h k_h v_h z_h`` (the value
  heads of h together); ``in_proj_ba`` holds ``b_h a_h``. Our ``attn.in_proj`` is part-major:
  ``q k v z b a``, each over all heads (:class:`~..sources.Grouped` regroups);
- ``self_attn.q_proj`` holds, for each head, its query then its output gate; our
  ``attn.qkv`` is ``q gate k v``;
- ``linear_attn.conv1d.weight`` is ``[C, 1, K]``, ours ``[C, K]``.

The pieces shared with Qwen3.5 (:mod:`.qwen3_5_moe`) live here: the layer types, the
attention and Gated DeltaNet sizes and the refusals."""

from __future__ import annotations

from typing import Any

from moe_fold.config import Config, head_dim, layer_mixer

from ..sources import Cat, Grouped, Source, Squeezed, Take
from . import standard
from .base import Family, Keys, Refuse, attention_heads, common_sizes, rope_theta

# Hugging Face's layer type -> ours
LAYER_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
_TO_HF = {ours: theirs for theirs, ours in LAYER_TYPES.items()}

# Gated DeltaNet: our field -> (its key, transformers' default)
_LINEAR = {"linear_num_key_heads": ("linear_num_key_heads", 16),
           "linear_num_value_heads": ("linear_num_value_heads", 32),
           "linear_key_head_dim": ("linear_key_head_dim", 128), "linear_value_head_dim": ("linear_value_head_dim", 128),
           "linear_conv_kernel": ("linear_conv_kernel_dim", 4)}


def hybrid_from_hf(keys: Keys, config: Config, family: str, *, rope_extra: tuple = ()) -> None:
    """What Qwen3-Next and Qwen3.5 read alike: sizes, the gated attention (its heads, QK-norm,
    partial rotary), the Gated DeltaNet sizes, the layer types, softmax routing with a gated
    shared expert. ``rope_extra``: keys of ``rope_parameters`` the family checks itself."""
    m, moe = config.model, config.moe
    common_sizes(keys, m, family, norm_eps=1e-6)
    attention_heads(keys, m, head_dim=256)  # transformers' default head_dim
    params = keys.get("rope_parameters", {})
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    # transformers defaults the factor to 0.25 when neither place sets it.
    m.partial_rotary_factor = float(inner if inner is not None else keys.get("partial_rotary_factor", 0.25))
    if rope_extra and isinstance(params, dict):
        keys.hf = {**keys.hf, "rope_parameters": {k: v for k, v in params.items() if k not in rope_extra}}
    m.rope_theta = rope_theta(keys, 1e4, partial_rotary=True)
    keys.must_be("hidden_act", ("silu",), "the MLPs, experts and the Gated DeltaNet conv use SiLU here")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    keys.must_be("attention_bias", (False,), f"{family}'s attention projections have no biases here")
    m.qk_norm, m.qk_norm_scope, m.qkv_bias = True, "head", False
    m.attn_output_gate, m.norm_zero_centred = True, True
    for ours, (theirs, default) in _LINEAR.items():
        setattr(m, ours, int(keys.get(theirs, default)))
    types = keys.get("layer_types", None)
    interval = keys.get("full_attention_interval", 4)  # the pattern when layer_types is not given
    if types is None:
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(m.num_layers)]
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd:
        keys.problems.append(f"layer_types has {odd}: only linear_attention (Gated DeltaNet) and full_attention "
                             f"are known")
    elif len(types) != m.num_layers:
        keys.problems.append(f"layer_types has {len(types)} entries; num_hidden_layers={m.num_layers} needs one each")
    else:
        m.layer_types = [LAYER_TYPES[t] for t in types]
    standard.softmax_routing_from_hf(keys, config)
    moe.shared_expert_ffn_hidden_size = int(keys.get("shared_expert_intermediate_size"))
    moe.shared_expert_gate = True


def from_hf(keys: Keys, config: Config) -> None:
    hybrid_from_hf(keys, config, "qwen3_next")
    config.model.ffn_hidden_size = keys.get("intermediate_size", 5632)
    keys.must_be("use_sliding_window", (False,), "Qwen3-Next's attention layers are full attention")
    standard.qwen_moe_layers_from_hf(keys, config)


def hybrid_refusals(config: Config, refuse: Refuse, family: str) -> None:
    """What Qwen3-Next and Qwen3.5 cannot hold."""
    m, moe = config.model, config.moe
    refuse(m.layer_types is not None and "kda" in m.layer_types,
           f"model.layer_types={m.layer_types}: {family}'s linear layers are Gated DeltaNet, not KDA")
    refuse(moe.score_function != "softmax", f"moe.score_function={moe.score_function}: {family} routes with softmax")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: {family} has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: {family} does not scale probs")
    refuse(moe.expert_bias, f"moe.expert_bias=true: {family} has no expert bias")
    refuse(moe.shared_expert_ffn_hidden_size == 0 or not moe.shared_expert_gate,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}, moe.shared_expert_gate="
           f"{str(moe.shared_expert_gate).lower()}: {family} always has one gated shared expert")
    refuse(not m.qk_norm or m.qk_norm_scope != "head",
           f"model.qk_norm={str(m.qk_norm).lower()} (scope {m.qk_norm_scope}): {family} normalises each query and "
           f"key head")
    refuse(m.qkv_bias, f"model.qkv_bias=true: {family} has no q|k|v biases")
    refuse(not m.attn_output_gate, f"model.attn_output_gate=false: {family}'s attention always has the output gate")
    refuse(not m.norm_zero_centred, f"model.norm_zero_centred=false: {family}'s RMSNorm weights are zero-centred")


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    hybrid_refusals(config, refuse, "qwen3_next")


def hybrid_to_hf(config: Config) -> dict[str, Any]:
    """The keys Qwen3-Next and Qwen3.5 write alike."""
    m, moe = config.model, config.moe
    types = m.layer_types or ["attention"] * m.num_layers
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        **{theirs: getattr(m, ours) for ours, (theirs, _) in _LINEAR.items()},
        "layer_types": [_TO_HF[t] for t in types],
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size,
        "shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }


def to_hf(config: Config, flags: list) -> dict:
    hf = hybrid_to_hf(config)
    hf.update(intermediate_size=config.model.ffn_hidden_size, norm_topk_prob=not config.moe.pre_softmax,
              decoder_sparse_step=1, mlp_only_layers=[i for i, f in enumerate(flags) if not f])
    return hf


def gated_attention_sources(config: Config, hf: str, ours: str) -> dict[str, Source]:
    """The gated full attention: ``q_proj`` (per head its query, then its gate), ``k_proj``,
    ``v_proj`` -> our ``qkv`` (q | gate | k | v); ``o_proj``; the QK-norms."""
    m = config.model
    hd = head_dim(config)
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    attn = f"{hf}self_attn."
    query = Grouped(Take(f"{attn}q_proj.weight"), 0, m.num_heads, (hd, hd))
    return {f"{ours}attn.qkv.weight": Cat(0, (query, Take(f"{attn}k_proj.weight"), Take(f"{attn}v_proj.weight")),
                                          (2 * q, kv, kv)),
            f"{ours}attn.proj.weight": Take(f"{attn}o_proj.weight"),
            f"{ours}attn.q_norm.weight": Take(f"{attn}q_norm.weight"),
            f"{ours}attn.k_norm.weight": Take(f"{attn}k_norm.weight")}


def deltanet_sources(config: Config, hf: str, ours: str, in_proj: Source) -> dict[str, Source]:
    """A Gated DeltaNet layer's tensors under ``hf + "linear_attn."``, its input projection
    ``in_proj`` (the family's) as our ``attn.in_proj`` (q | k | v | z | b | a)."""
    lin = f"{hf}linear_attn."
    return {f"{ours}attn.in_proj.weight": in_proj,
            f"{ours}attn.conv_weight": Squeezed(f"{lin}conv1d.weight", 1),
            f"{ours}attn.A_log": Take(f"{lin}A_log"),
            f"{ours}attn.dt_bias": Take(f"{lin}dt_bias"),
            f"{ours}attn.norm_weight": Take(f"{lin}norm.weight"),
            f"{ours}attn.out_proj.weight": Take(f"{lin}out_proj.weight")}


def mixer_sources(config: Config, layer: int, hf: str, ours: str) -> dict[str, Source]:
    m = config.model
    if layer_mixer(m, layer) != "gated_deltanet":
        return gated_attention_sources(config, hf, ours)
    nk, nv, dk, dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    r = nv // nk  # value heads per key head
    lin = f"{hf}linear_attn."
    in_proj = Cat(0, (Grouped(Take(f"{lin}in_proj_qkvz.weight"), 0, nk, (dk, dk, r * dv, r * dv)),
                      Grouped(Take(f"{lin}in_proj_ba.weight"), 0, nk, (r, r))),
                  (2 * nk * dk + 2 * nv * dv, 2 * nv))
    return deltanet_sources(config, hf, ours, in_proj)


def uses_hybrid_layers(config: Config) -> bool:
    m = config.model
    return (m.layer_types is not None and "gated_deltanet" in m.layer_types) or m.attn_output_gate \
        or m.norm_zero_centred


FAMILY = Family(
    model_type="qwen3_next", architecture="Qwen3NextForCausalLM",
    features=frozenset({"partial_rotary", "layer_types", "attn_output_gate", "norm_zero_centred"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=uses_hybrid_layers, export_priority=5, mixer_sources=mixer_sources)
