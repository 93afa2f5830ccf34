"""Qwen3.5's MoE models, their text part (``Qwen3_5MoeForCausalLM``,
docs/families/qwen3_5_moe.md): Qwen3-Next's layers (:mod:`.qwen3_next`) with every layer
MoE and the top-k always renormalised.

Two ``config.json`` forms are read: the text model's own (``model_type: qwen3_5_moe_text``,
what ``Qwen3_5MoeForCausalLM`` saves and what export writes), and the multimodal wrapper's
(``model_type: qwen3_5_moe``, the text model's keys under ``text_config``, its tensors
under ``model.language_model.``). A wrapper with a vision tower (``vision_config``) is
refused: moe-fold trains the text model only. The text rotary embedding is multimodal
(``mrope_section``): for text, the three position rows are equal and it is the plain one.

Tensors: ``linear_attn.in_proj_qkv`` (q | k | v over all heads, as ours), ``in_proj_z``,
``in_proj_b``, ``in_proj_a``; the rest as Qwen3-Next's."""

from __future__ import annotations

from moe_fold.config import Config, layer_mixer

from ..sources import Cat, Source, Take
from . import qwen3_next
from .base import Family, Keys, Refuse

# The wrapper's keys that concern images and video only.
_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_WRAPPER = "model.language_model."


def from_hf(keys: Keys, config: Config) -> None:
    text = keys.get("text_config", None)
    if text is None:  # the text model's own config
        _text_from_hf(keys, config)
        return
    vision = keys.get("vision_config", None)
    if vision is not None:
        keys.problems.append(f"vision_config is set (a vision tower of depth {vision.get('depth', '?')}): moe-fold "
                             f"imports the text model of qwen3_5_moe only; a checkpoint with a vision tower is refused "
                             f"(save the text model, Qwen3_5MoeForCausalLM, or drop vision_config and the model.visual "
                             f"tensors)")
    for key in _VISION_TOKENS:
        keys.get(key, None)
    inner = Keys(text, "qwen3_5_moe", keys.problems)
    inner.get("model_type", None)
    top_tie = keys.get("tie_word_embeddings", None)
    _text_from_hf(inner, config)
    if top_tie is not None and bool(top_tie) != config.model.tie_embeddings:
        keys.problems.append(f"tie_word_embeddings={top_tie!r} disagrees with text_config.tie_word_embeddings="
                             f"{config.model.tie_embeddings!r}")
    unknown = inner.unknown()
    if unknown:
        keys.problems.append(f"text_config.{', text_config.'.join(unknown)}: not understood by moe-fold's "
                             f"qwen3_5_moe importer (a setting it cannot represent is refused rather than ignored)")


def _text_from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    params = keys.get("rope_parameters", {})
    if isinstance(params, dict) and params.get("mrope_section") is not None:
        section = params["mrope_section"]
        head = keys.get("head_dim", 256)
        factor = params.get("partial_rotary_factor", 0.25)
        if sum(section) * 2 != int(head * factor):
            keys.problems.append(f"rope_parameters.mrope_section={section} covers {sum(section) * 2} rotary dims; "
                                 f"head_dim={head} x partial_rotary_factor={factor} has {int(head * factor)}")
    qwen3_next.hybrid_from_hf(keys, config, "qwen3_5_moe", rope_extra=("mrope_section", "mrope_interleaved"))
    moe.num_experts = keys.get("num_experts")
    moe.ffn_hidden_size = keys.get("moe_intermediate_size")
    moe.moe_layer_freq, moe.pre_softmax = 1, False
    m.ffn_hidden_size = moe.ffn_hidden_size  # no dense layers


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    qwen3_next.hybrid_refusals(config, refuse, "qwen3_5_moe")
    refuse(not all(flags), f"MoE layers {[int(f) for f in flags]}: every Qwen3.5 MoE layer is MoE "
                           f"(moe.moe_layer_freq, moe.first_k_dense)")
    refuse(config.moe.pre_softmax, "moe.pre_softmax=true: Qwen3.5 always renormalises the top-k probabilities")


def to_hf(config: Config, flags: list) -> dict:
    # The text model's own config: a qwen3_5_moe config.json would be read as the multimodal wrapper.
    return {"model_type": "qwen3_5_moe_text", **qwen3_next.hybrid_to_hf(config)}


def mixer_sources(config: Config, layer: int, hf: str, ours: str) -> dict[str, Source]:
    m = config.model
    if layer_mixer(m, layer) != "gated_deltanet":
        return qwen3_next.gated_attention_sources(config, hf, ours)
    key, value, nv = (m.linear_num_key_heads * m.linear_key_head_dim,
                      m.linear_num_value_heads * m.linear_value_head_dim, m.linear_num_value_heads)
    lin = f"{hf}linear_attn."
    in_proj = Cat(0, tuple(Take(f"{lin}in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")),
                  (2 * key + value, value, nv, nv))
    return qwen3_next.deltanet_sources(config, hf, ours, in_proj)


FAMILY = Family(
    model_type="qwen3_5_moe", architecture="Qwen3_5MoeForCausalLM",
    features=qwen3_next.FAMILY.features,
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    # A model both can hold exports as Qwen3-Next (the more general); Qwen3.5 when asked by name.
    exports=lambda config: False, export_priority=6, mixer_sources=mixer_sources,
    aliases=("qwen3_5_moe_text",), import_architectures=("Qwen3_5MoeForConditionalGeneration",),
    model_prefix=lambda hf_names: _WRAPPER if any(n.startswith(_WRAPPER) for n in hf_names) else "model.")
