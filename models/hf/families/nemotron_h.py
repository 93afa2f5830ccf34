"""Nemotron-H / Nemotron 3 (``NemotronHForCausalLM``, docs/families/nemotron-h.md): every layer
is one mixer under one pre-norm and residual (``model.block: single_mixer``), as
``layers_block_type`` (or the older ``hybrid_override_pattern``: M, *, -, E) names it:
Mamba2 (``linear_attention`` -> ``mamba2``), attention without rotary embeddings
(``full_attention`` -> ``attention`` with ``model.rope_layers`` all 0), a dense relu2 MLP
(``mlp``) or an MoE layer (``moe``) of relu2 experts (``moe.activation: relu2``) with one
ungated relu2 shared expert of ``moe_shared_expert_intermediate_size``, and with
``moe_latent_size`` (Nemotron 3 Super) the latent MoE (``moe.latent_size``: the experts work in
the latent width between ``fc1_latent_proj`` and ``fc2_latent_proj``); DeepSeek-V3's
routing (sigmoid scores, the ``e_score_correction_bias``, groups ranked by their best two
scores, top-k renormalised and scaled by ``routed_scaling_factor``).

Tensors: checkpoints hold ``backbone.`` (transformers renames it ``model.`` in memory):
``embeddings``, ``norm_f``, per layer ``norm`` and ``mixer.*``; Mamba2's ``in_proj`` rows
(z|x|B|C|dt) and conv channels (x|B|C) are ours as they are (the conv ``[C, 1, K]``, ours
``[C, K]``); experts per expert (``mixer.experts.{e}.up_proj``/``down_proj``), or fused
``[E, out, in]`` as transformers holds them in memory.

Refused: MTP depths, biases on any linear, a Mamba2 conv without its bias."""

from __future__ import annotations

from typing import Any

from moe_fold.config import Config, group_ranked_scores, head_dim, layer_mixer

from ..sources import Cat, Source, Squeezed, Stack, Take
from .base import Family, Keys, Refuse
from .deepseek_common import deepseek_moe_from_hf

# Hugging Face's layer type -> ours; the older pattern's letters.
LAYER_TYPES = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_TO_HF = {ours: theirs for theirs, ours in LAYER_TYPES.items()}
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

# Mamba2: our field -> (its key, transformers' default)
_MAMBA = {"mamba_num_heads": ("mamba_num_heads", 128), "mamba_head_dim": ("mamba_head_dim", 64),
          "mamba_state_size": ("ssm_state_size", 128), "mamba_num_groups": ("n_groups", 8),
          "mamba_conv_kernel": ("conv_kernel", 4), "mamba_chunk_size": ("chunk_size", 128)}

_T = (1, 0)  # [out, in] <-> our expert layout [in, out]


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    m.vocab_size = keys.get("vocab_size")
    m.hidden_size = keys.get("hidden_size")
    m.num_heads = keys.get("num_attention_heads")
    m.num_kv_heads = keys.get("num_key_value_heads", m.num_heads)
    m.head_dim = keys.get("head_dim", 128)
    m.norm_eps = float(keys.get("layer_norm_epsilon", 1e-5))
    keys.must_be("tie_word_embeddings", (False,), "transformers' NemotronHForCausalLM never ties its head to the "
                                                  "embedding (its lm_head is its own tensor)")
    m.tie_embeddings = False
    m.init_std = float(keys.get("initializer_range", 0.02))
    m.ffn_hidden_size = keys.get("intermediate_size", 21504)
    types = keys.get("layers_block_type", None)
    pattern = keys.get("hybrid_override_pattern", None)
    if types is None and pattern is not None:
        odd = sorted(set(pattern) - set(_PATTERN))
        if odd:
            keys.problems.append(f"hybrid_override_pattern={pattern!r} has {odd}: only M, *, - and E are known")
        types = [_PATTERN.get(c, c) for c in pattern]
    if types is None:
        types = ["linear_attention", "moe", "full_attention", "mlp"]  # transformers' default
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd:
        keys.problems.append(f"layers_block_type has {odd}: only {', '.join(LAYER_TYPES)} are known")
    m.layer_types = [LAYER_TYPES.get(t, t) for t in types]
    m.num_layers = len(types)
    declared = keys.get("num_hidden_layers", None)
    if declared is not None and declared != m.num_layers:
        keys.problems.append(f"num_hidden_layers={declared} disagrees with the {m.num_layers} layer types")
    m.block, m.mlp_activation, moe.activation = "single_mixer", "relu2", "relu2"
    m.rope_layers = [0] * m.num_layers  # Nemotron-H's attention has no position embedding
    m.qk_norm, m.qkv_bias = False, False
    for ours, (theirs, default) in _MAMBA.items():
        setattr(m, ours, int(keys.get(theirs, default)))
    m.mamba_dt_min = float(keys.get("time_step_min", 0.001))
    m.mamba_dt_max = float(keys.get("time_step_max", 0.1))
    # Initialisation only, or not read by transformers' forward: the step limit is
    # (time_step_min, inf) whatever time_step_limit says.
    for key in ("time_step_floor", "time_step_limit", "expand", "rescale_prenorm_residual", "residual_in_fp32",
                "mamba_ssm_cache_dtype", "use_mamba_kernels", "num_logits_to_keep", "moe_shared_expert_overlap",
                "n_shared_experts", "mtp_layers_block_type"):
        keys.get(key, None)
    keys.must_be("mlp_hidden_act", ("relu2",), "the MLPs and experts are relu2 here")
    keys.must_be("mamba_hidden_act", ("silu",), "Mamba2's conv is followed by SiLU here")
    keys.must_be("use_conv_bias", (True,), "Mamba2's conv has a bias here")
    for key in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
        keys.must_be(key, (False,), "the linears have no biases here")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("hidden_dropout", (0.0, 0), "the residual stream has no dropout here")
    keys.must_be("sliding_window", (None,), "Nemotron-H's attention is full causal attention here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    latent = keys.get("moe_latent_size", None)
    moe.latent_size = None if latent is None else int(latent)
    deepseek_moe_from_hf(keys, config)
    moe.shared_expert_ffn_hidden_size = int(keys.get("moe_shared_expert_intermediate_size", 7688))


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    refuse(m.block != "single_mixer" or m.layer_types is None,
           f"model.block={m.block}: every Nemotron-H layer is one mixer (model.block=single_mixer)")
    others = sorted({t for t in (m.layer_types or []) if t not in _TO_HF})
    refuse(bool(others), f"model.layer_types has {others}: Nemotron-H has mamba2, attention, mlp and moe layers")
    refuse(m.mlp_activation != "relu2", f"model.mlp_activation={m.mlp_activation}: Nemotron-H's MLPs are relu2")
    refuse(moe.activation != "relu2", f"moe.activation={moe.activation}: Nemotron-H's experts are relu2")
    refuse(m.attention != "mha", f"model.attention={m.attention}: Nemotron-H has standard attention")
    refuse(m.rope_layers is None or any(m.rope_layers),
           f"model.rope_layers={m.rope_layers}: Nemotron-H's attention has no rotary embeddings (all 0)")
    refuse(m.qk_norm, "model.qk_norm=true: Nemotron-H has no QK-norm")
    refuse(m.tie_embeddings, "model.tie_embeddings=true: transformers' Nemotron-H never ties its head")
    refuse(m.qkv_bias, "model.qkv_bias=true: Nemotron-H has no q|k|v biases")
    refuse(moe.shared_expert_ffn_hidden_size == 0 or moe.shared_expert_gate,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}, moe.shared_expert_gate="
           f"{str(moe.shared_expert_gate).lower()}: Nemotron-H has one ungated shared expert")
    refuse(moe.score_function != "sigmoid", f"moe.score_function={moe.score_function}: Nemotron-H routes with "
                                            f"sigmoid scores")
    refuse(not moe.expert_bias, "moe.expert_bias=false: the router always has its score correction bias")
    refuse(moe.topk < 2, f"moe.topk={moe.topk}: the top-k sigmoid probabilities are renormalised, which "
                         f"moe-fold does only for k > 1")
    ranked = None if moe.num_groups is None else group_ranked_scores(moe.group_score, moe.topk, moe.group_topk)
    refuse(ranked not in (None, 2),
           f"moe.group_score={moe.group_score} with moe.topk={moe.topk} and moe.group_topk={moe.group_topk}: "
           f"Nemotron-H ranks a group by the sum of its best 2 scores, this model by its best {ranked}")


def to_hf(config: Config, flags: list) -> dict[str, Any]:
    m, moe = config.model, config.moe
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config), "intermediate_size": m.ffn_hidden_size,
        "layers_block_type": [_TO_HF[t] for t in m.layer_types], "layer_norm_epsilon": m.norm_eps,
        "tie_word_embeddings": False, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
        **{theirs: getattr(m, ours) for ours, (theirs, _) in _MAMBA.items()},
        "time_step_min": m.mamba_dt_min, "time_step_max": m.mamba_dt_max, "use_conv_bias": True,
        "use_bias": False, "mamba_proj_bias": False, "mlp_bias": False, "attention_bias": False,
        "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size, "n_shared_experts": 1,
        "norm_topk_prob": True, "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
        "num_nextn_predict_layers": 0, "moe_latent_size": moe.latent_size,
    }


def layer_sources(config: Config, layer: int, hf: str, ours: str, hf_names: frozenset) -> dict[str, Source]:
    """Layer ``layer``: its ``norm`` and its one ``mixer``."""
    m, moe = config.model, config.moe
    kind = layer_mixer(m, layer)
    mixer = f"{hf}mixer."
    norm = Take(f"{hf}norm.weight")
    if kind == "mamba2":
        return {f"{ours}attn_norm.weight": norm,
                f"{ours}attn.in_proj.weight": Take(f"{mixer}in_proj.weight"),
                f"{ours}attn.conv_weight": Squeezed(f"{mixer}conv1d.weight", 1),
                f"{ours}attn.conv_bias": Take(f"{mixer}conv1d.bias"),
                **{f"{ours}attn.{name}": Take(f"{mixer}{name}") for name in ("A_log", "D", "dt_bias")},
                f"{ours}attn.norm_weight": Take(f"{mixer}norm.weight"),
                f"{ours}attn.out_proj.weight": Take(f"{mixer}out_proj.weight")}
    if kind == "attention":
        q, kv = m.num_heads * head_dim(config), m.num_kv_heads * head_dim(config)
        return {f"{ours}attn_norm.weight": norm,
                f"{ours}attn.qkv.weight": Cat(0, tuple(Take(f"{mixer}{p}_proj.weight") for p in "qkv"), (q, kv, kv)),
                f"{ours}attn.proj.weight": Take(f"{mixer}o_proj.weight")}
    if kind == "mlp":
        return {f"{ours}mlp_norm.weight": norm, f"{ours}mlp.fc1.weight": Take(f"{mixer}up_proj.weight"),
                f"{ours}mlp.fc2.weight": Take(f"{mixer}down_proj.weight")}
    if f"{mixer}experts.up_proj" in hf_names:
        fc1, fc2 = Take(f"{mixer}experts.up_proj", (0, 2, 1)), Take(f"{mixer}experts.down_proj", (0, 2, 1))
    else:
        fc1 = Stack(tuple(Take(f"{mixer}experts.{e}.up_proj.weight", _T) for e in range(moe.num_experts)))
        fc2 = Stack(tuple(Take(f"{mixer}experts.{e}.down_proj.weight", _T) for e in range(moe.num_experts)))
    latent = {} if moe.latent_size is None else {
        f"{ours}mlp.latent_in.weight": Take(f"{mixer}fc1_latent_proj.weight"),
        f"{ours}mlp.latent_out.weight": Take(f"{mixer}fc2_latent_proj.weight")}
    return {f"{ours}mlp_norm.weight": norm,
            f"{ours}mlp.router.weight": Take(f"{mixer}gate.weight"), **latent,
            f"{ours}mlp.router.expert_bias": Take(f"{mixer}gate.e_score_correction_bias"),
            f"{ours}mlp.experts.fc1": fc1, f"{ours}mlp.experts.fc2": fc2,
            f"{ours}mlp.shared_expert.fc1.weight": Take(f"{mixer}shared_experts.up_proj.weight"),
            f"{ours}mlp.shared_expert.fc2.weight": Take(f"{mixer}shared_experts.down_proj.weight")}


def _prefix(hf_names: frozenset) -> str:
    """Checkpoints hold ``backbone.``; a model transformers converted in memory, ``model.``."""
    return "model." if any(n.startswith("model.") for n in hf_names) else "backbone."


def _exports(config: Config) -> bool:
    m = config.model
    return m.block == "single_mixer" or (m.layer_types is not None and "mamba2" in m.layer_types)


FAMILY = Family(
    model_type="nemotron_h", architecture="NemotronHForCausalLM",
    features=frozenset({"layer_types", "rope_layers", "expert_activation", "single_mixer", "mlp_activation",
                        "mamba2", "moe_latent"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf, exports=_exports, export_priority=4,
    layer_sources=layer_sources, model_prefix=_prefix, embed_name="embeddings.weight", final_norm_name="norm_f.weight")
