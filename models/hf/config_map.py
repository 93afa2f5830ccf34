"""Hugging Face ``config.json`` <-> our :class:`~moe_fold.config.Config`, for every family of
the registry (:mod:`.families`; docs/families/ has a page per family).

Import is strict: every key of ``config.json`` is either mapped to a field of ours,
checked to hold a value we compute the same way (``hidden_act: silu``, no rope scaling,
a sliding window no shorter than ``model.seq_length``...), or on the short list of keys
that do not change the forward math (:data:`METADATA_KEYS`). Anything else is an error
naming the key, so a model never loads into a network that computes something else.

Export refuses, by field, what the target family cannot hold: first each model feature
of :data:`FEATURE_USE` the model uses and the family's feature set lacks, then the family's
own refusals. This module holds no family's particulars: each family module does.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

from moe_fold.config import Config, moe_layer_flags

from .families import FAMILIES, METADATA_KEYS, REGISTRY, HFConfigError, lookup
from .families.base import YARN_KEYS, Keys

__all__ = ["FAMILIES", "METADATA_KEYS", "FEATURE_USE", "HFConfigError", "hf_family", "config_from_hf",
           "config_to_hf", "export_family"]


def hf_family(hf: dict) -> str:
    """The family (its ``model_type``: ``mixtral``, ``qwen2_moe``...) of a parsed ``config.json``
    (whose ``model_type`` may be one the family reads besides its own: its ``aliases``)."""
    model_type = hf.get("model_type")
    family = lookup(model_type, aliases=True)
    archs = hf.get("architectures")
    accepted = (family.architecture,) + family.import_architectures
    if archs is not None and (len(archs) != 1 or archs[0] not in accepted):
        raise HFConfigError([f"architectures={archs!r}: only {' or '.join(f'[{a!r}]' for a in accepted)} is "
                             f"supported for model_type={model_type!r}"], "unsupported Hugging Face model")
    return family.model_type


def _reset_family_fields(config: Config) -> None:
    """Nothing of a base config's family-specific fields stays: the importing family sets
    what it has (MLA, YaRN, the attention features, expert-input scaling, gpt-oss's biases
    and activation, ERNIE-4.5's renormalisation floor, MTP, partial rotary, Qwen3-Next's
    layer types, output gate and zero-centred norms, zero experts, LongCat-Flash's blocks and
    MLA scaling, DSA, Nemotron-H's single-mixer layers, relu2 MLPs and latent MoE)."""
    m, moe = config.model, config.moe
    m.qk_norm_scope, m.partial_rotary_factor, m.mtp_num_layers = "head", 1.0, 0
    moe.topk_norm_min = None
    m.attention_sinks, m.sliding_window, m.attention_chunk = False, 0, 0
    m.local_attention_layers, m.rope_layers = None, None
    m.attn_temperature_tuning, m.attn_temperature_scale, m.attn_temperature_floor = False, 0.1, 8192
    moe.score_on_input = False
    moe.zero_experts = 0
    moe.latent_size = None
    m.attention_out_bias = False
    moe.router_bias, moe.expert_linear_bias, moe.activation = False, False, "swiglu"
    m.attention, m.rope_interleave, m.rope_scaling = "mha", False, None
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 *YARN_KEYS.values()):
        setattr(m, name, None)
    m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_truncate = 32.0, 1.0, True
    m.layer_types, m.attn_output_gate, m.norm_zero_centred = None, False, False
    m.block, m.mla_lora_scale, m.mla_norm_eps = "standard", False, None
    m.dsa, m.indexer_types, m.index_rope_interleave = False, None, False
    m.mlp_activation = "swiglu"


def config_from_hf(hf: dict, base: Optional[Config] = None) -> Config:
    """Our Config for the Hugging Face config ``hf`` (a parsed ``config.json``).

    The architecture (``model`` fields but ``seq_length``; the ``moe`` fields that change
    the forward) comes from ``hf``; everything else (parallel layout, dispatcher,
    training, data) from ``base`` (default: ``Config()`` with ``model.seq_length`` set
    to ``max_position_embeddings``). Raises :class:`HFConfigError` listing every key we
    cannot represent."""
    name = hf_family(hf)
    keys = Keys(hf, name, [])
    config = copy.deepcopy(base) if base is not None else Config()
    if base is None:
        config.model.seq_length = int(keys.get("max_position_embeddings", config.model.seq_length))
    _reset_family_fields(config)
    REGISTRY[name].from_hf(keys, config)
    unknown = keys.unknown()
    if unknown:
        keys.problems.append(f"{', '.join(unknown)}: not understood by moe-fold's {name} importer "
                             f"(a setting it cannot represent is refused rather than ignored)")
    if keys.problems:
        raise HFConfigError(keys.problems, f"cannot import {name} config")
    return config


# Feature -> (whether a config uses it, the refusal naming the field for a family that lacks
# it), in the order the exporter checks them.
FEATURE_USE: dict[str, tuple[Callable[[Config], bool], Callable[[Config, str], str]]] = {
    "mla": (lambda c: c.model.attention == "mla",
            lambda c, f: f"model.attention=mla: {f} has standard attention (DeepSeek-V2 and -V3 have MLA)"),
    "mla_norm_eps": (lambda c: c.model.mla_norm_eps not in (None, c.model.norm_eps),
                     lambda c, f: f"model.mla_norm_eps={c.model.mla_norm_eps}: {f}'s latent norms use "
                                  f"model.norm_eps={c.model.norm_eps} (DeepSeek's, Kimi-Linear's and LongCat-Flash's use 1e-6)"),
    "qk_norm_scope": (lambda c: c.model.qk_norm and c.model.qk_norm_scope != "head",
                      lambda c, f: f"model.qk_norm_scope={c.model.qk_norm_scope}: {f} normalises each head (OLMoE "
                                   f"normalises the whole projections)"),
    "partial_rotary": (lambda c: c.model.partial_rotary_factor != 1.0,
                       lambda c, f: f"model.partial_rotary_factor={c.model.partial_rotary_factor}: {f} rotates the "
                                    f"whole head (GLM-4.5 and MiniMax-M2 rotate a part)"),
    "mtp": (lambda c: c.model.mtp_num_layers > 0,
            lambda c, f: f"model.mtp_num_layers={c.model.mtp_num_layers}: {f} has no multi-token prediction "
                         f"(DeepSeek-V3 and GLM-4.5 have)"),
    "rope_interleave": (lambda c: c.model.rope_interleave,
                        lambda c, f: f"model.rope_interleave=true: {f} rotates two halves of each head (DeepSeek, "
                                     f"ERNIE-4.5 and Llama-4 rotate interleaved pairs)"),
    "topk_norm_min": (lambda c: c.moe.topk_norm_min is not None,
                      lambda c, f: f"moe.topk_norm_min={c.moe.topk_norm_min}: {f} has no renormalisation floor "
                                   f"(ERNIE-4.5's moe_norm_min)"),
    "router_bias": (lambda c: c.moe.router_bias,
                    lambda c, f: f"moe.router_bias=true: {f}'s router has no bias (gpt-oss's has)"),
    "expert_linear_bias": (lambda c: c.moe.expert_linear_bias,
                           lambda c, f: f"moe.expert_linear_bias=true: {f}'s experts have no biases (gpt-oss's have)"),
    "expert_activation": (lambda c: c.moe.activation != "swiglu",
                          lambda c, f: f"moe.activation={c.moe.activation}: {f}'s experts are plain SwiGLU"),
    "attention_out_bias": (lambda c: c.model.attention_out_bias,
                           lambda c, f: f"model.attention_out_bias=true: {f}'s output projection has no bias "
                                        f"(gpt-oss's has)"),
    "yarn": (lambda c: c.model.rope_scaling == "yarn",
             lambda c, f: f"model.rope_scaling=yarn: {f} has unscaled rotary embeddings here"),
    **{name: ((lambda c, name=name, off=off: getattr(c.model, name) != off),
              (lambda c, f, name=name: f"model.{name}={getattr(c.model, name)!r}: {f} has no such attention "
                                       f"setting"))
       for name, off in (("attention_sinks", False), ("sliding_window", 0), ("attention_chunk", 0),
                         ("rope_layers", None), ("attn_temperature_tuning", False))},
    "zero_experts": (lambda c: c.moe.zero_experts > 0,
                     lambda c, f: f"moe.zero_experts={c.moe.zero_experts}: {f} has no zero-computation experts"),
    "moe_latent": (lambda c: c.moe.latent_size is not None,
                   lambda c, f: f"moe.latent_size={c.moe.latent_size}: {f}'s experts work in the hidden width "
                                f"(Nemotron 3 Super has a latent MoE)"),
    "shortcut_moe": (lambda c: c.model.block == "shortcut_moe",
                     lambda c, f: f"model.block=shortcut_moe: {f}'s blocks are attention then one MLP (LongCat-Flash "
                                  f"has two attention sublayers and a shortcut-connected MoE)"),
    "mla_lora_scale": (lambda c: c.model.mla_lora_scale,
                       lambda c, f: f"model.mla_lora_scale=true: {f} does not scale the MLA latents"),
    "score_on_input": (lambda c: c.moe.score_on_input,
                       lambda c, f: f"moe.score_on_input=true: {f} scales each expert's output by its prob"),
    "single_mixer": (lambda c: c.model.block == "single_mixer",
                     lambda c, f: f"model.block=single_mixer: {f}'s layers are attention + MLP "
                                         f"(Nemotron-H has one mixer per layer)"),
    "mlp_activation": (lambda c: c.model.mlp_activation != "swiglu",
                       lambda c, f: f"model.mlp_activation={c.model.mlp_activation}: {f}'s MLPs are SwiGLU"),
    "mamba2": (lambda c: c.model.layer_types is not None and "mamba2" in c.model.layer_types,
               lambda c, f: f"model.layer_types={c.model.layer_types}: {f} has no Mamba2 layers (Nemotron-H has)"),
    "layer_types": (lambda c: c.model.layer_types is not None and set(c.model.layer_types) != {"attention"},
                    lambda c, f: f"model.layer_types={c.model.layer_types}: {f} has attention on every layer "
                                 f"(Qwen3-Next and Qwen3.5 have Gated DeltaNet layers, Kimi-Linear KDA layers)"),
    "attn_output_gate": (lambda c: c.model.attn_output_gate,
                         lambda c, f: f"model.attn_output_gate=true: {f}'s attention has no output gate"),
    "dsa": (lambda c: c.model.dsa,
            lambda c, f: f"model.dsa=true: {f} has dense attention (DeepSeek-V3.2 and GLM-5 have DSA)"),
    "norm_zero_centred": (lambda c: c.model.norm_zero_centred,
                          lambda c, f: f"model.norm_zero_centred=true: {f}'s RMSNorm weights are not zero-centred"),
}


def export_family(config: Config) -> str:
    """The family a model of ``config`` exports to: the first family, in ``export_priority``
    order, whose ``exports`` says the model's features call for it (DeepSeek-V2 with MLA and
    softmax, DeepSeek-V3 with MLA and sigmoid, Llama-4 with expert-input scaling, chunked
    attention or the L2 QK-norm, gpt-oss with its biases, clamped SwiGLU or sinks, ERNIE-4.5
    with interleaved rotary pairs, a softmax expert bias or a top-k renormalisation floor,
    MiniMax-M2 with a QK-norm over the projections and sigmoid routing, OLMoE with a QK-norm
    over the projections, GLM-4.5 with an expert bias, partial rotary or MTP, Qwen3-MoE with
    QK-norm, Qwen2-MoE with a shared expert or q|k|v biases, else Mixtral)."""
    for family in sorted(REGISTRY.values(), key=lambda f: f.export_priority):
        if family.exports(config):
            return family.model_type
    raise HFConfigError([f"no family of {', '.join(REGISTRY)} exports this model"], "cannot export")


def config_to_hf(config: Config, family: Optional[str] = None, dtype: str = "float32") -> dict:
    """The ``config.json`` of ``family`` (default :func:`export_family`) for a model of
    ``config``; raises :class:`HFConfigError` naming each field that family cannot hold."""
    name = family or export_family(config)
    target = lookup(name, field="family", where="cannot export")
    flags = moe_layer_flags(config)
    problems: list[str] = []

    def refuse(condition: bool, text: str) -> None:
        if condition:
            problems.append(text)

    for feature, (uses, refusal) in FEATURE_USE.items():
        if feature not in target.features and uses(config):
            problems.append(refusal(config, name))
    target.refusals(config, flags, refuse)
    if problems:
        raise HFConfigError(problems, f"cannot export to {name}")
    return {"architectures": [target.architecture], "model_type": name, "dtype": dtype,
            **target.to_hf(config, flags)}
