"""Hugging Face ``config.json`` <-> our :class:`~moe_fold.config.Config`, for
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``,
``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, ``Glm4MoeForCausalLM``,
``OlmoeForCausalLM``, ``Ernie4_5_MoeForCausalLM``, ``MiniMaxM2ForCausalLM``,
``Llama4ForCausalLM`` and ``GptOssForCausalLM`` (docs/families/ has a table per family).

Import is strict: every key of ``config.json`` is either mapped to a field of ours,
checked to hold a value we compute the same way (``hidden_act: silu``, no rope scaling,
a sliding window no shorter than ``model.seq_length``...), or on the short list of keys
that do not change the forward math (:data:`METADATA_KEYS`). Anything else is an error
naming the key, so a model never loads into a network that computes something else.

Routing (Hugging Face takes top-k of the softmax over all experts, then renormalises
the k probabilities when asked to):

- Mixtral always renormalises, and Qwen ``norm_topk_prob: true`` does: the
  renormalised top-k of the full softmax equals the softmax over the k chosen logits,
  our ``moe.pre_softmax: false``;
- Qwen ``norm_topk_prob: false`` keeps the top-k of the full softmax as they are, our
  ``moe.pre_softmax: true``.

Layer pattern: Qwen's layer ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0``
and ``i`` is not in ``mlp_only_layers``; that becomes a 0/1 ``moe.moe_layer_freq`` list.
Training-only settings map too: ``router_aux_loss_coef`` -> ``moe.aux_loss_coeff``,
``router_jitter_noise`` -> ``moe.input_jitter`` (ours jitters the router's input only;
Mixtral's also scales the experts' input, which changes nothing at evaluation).

DeepSeek-V3: multi-head latent attention (``model.attention: mla`` with the same size
names), ``rope_interleave``, default or YaRN rotary (``rope_parameters``); sigmoid
scores with the ``e_score_correction_bias`` (our expert bias), renormalised over the
top-k (``norm_topk_prob: true``; we always renormalise sigmoid top-k > 1) and scaled by
``routed_scaling_factor``; group-limited routing that ranks a group by its best two
scores whatever ``num_experts_per_tok`` is (``moe.group_score: top2_sum``; the exporter
also takes Megatron-Core's ``topk_sum`` when topk = 2 x group_topk, where the two rules
agree, and refuses the others); ``n_shared_experts`` ungated shared experts of width
``moe_intermediate_size`` each (one shared expert of the summed width); the first
``first_k_dense_replace`` layers dense. ``num_nextn_predict_layers`` is
``model.mtp_num_layers`` (the importer keeps only the depths whose tensors the checkpoint
holds: transformers drops them when it saves).

GLM-4.5 (``Glm4MoeForCausalLM``): DeepSeek-V3's MoE layers, routing and MTP with
grouped-query attention: q|k|v biases (``attention_bias``), per-head QK-norm
(``use_qk_norm``) and rotary on the first ``partial_rotary_factor`` of each head.

OLMoE (``OlmoeForCausalLM``): softmax top-k without renormalisation (``norm_topk_prob:
false``, our ``pre_softmax: true``), and a QK-norm over the whole q and k projections
(``model.qk_norm_scope: projection``); ``clip_qkv`` must be null.

DeepSeek-V2 / V2-Lite: DeepSeek-V3's MLA (rotary pairs always interleaved) with softmax
routing: the top-k of the softmax over all experts as they are (``pre_softmax: true``),
``greedy`` or ``group_limited_greedy`` (a group ranks by its best score:
``group_score: max``), times ``routed_scaling_factor``.

ERNIE-4.5-MoE: standard attention with interleaved rotary pairs; MoE layers from a start
to an end layer every ``moe_layer_interval``; the expert bias added to the softmax over
all experts for the choice, the chosen probabilities divided by max(sum, ``moe_norm_min``)
(``expert_bias`` with ``pre_softmax``, ``topk_norm_min``).

MiniMax-M2: OLMoE's QK-norm over the projections, partial rotary (``rotary_dim``) and
DeepSeek-V3's biased, renormalised sigmoid top-k without groups, every layer MoE.

Llama-4 text (``Llama4ForCausalLM``, docs/families/llama4.md): top-1 sigmoid routing whose
prob scales the expert's input (``moe.score_on_input``), an ungated shared expert of the
experts' width, MoE on ``moe_layers``, chunked attention on the ``chunked_attention``
layers (``model.attention_chunk``, ``model.local_attention_layers``), no rotary where
``no_rope_layers`` is 0 (``model.rope_layers``), rotary in interleaved pairs, the
unweighted L2 QK-norm (``model.qk_norm_scope: l2``) and temperature tuning.

gpt-oss (``GptOssForCausalLM``, docs/families/gpt-oss.md): ``attention_bias`` on q, k, v
and o (``model.qkv_bias``, ``model.attention_out_bias``), attention sinks, a sliding window
on the ``layer_types`` ``sliding_attention`` layers, YaRN without truncation
(``model.yarn_truncate: false``); a router with bias and softmax over the top-k logits
(``moe.router_bias``, ``pre_softmax: false``); experts with biases and the clamped SwiGLU
(``moe.expert_linear_bias``, ``moe.activation: clamped_swiglu``, ``swiglu_alpha``,
``swiglu_limit``). MXFP4 checkpoints (``quantization_config``) are refused.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from moe_fold.config import Config, group_ranked_scores, head_dim, moe_layer_flags

__all__ = ["FAMILIES", "METADATA_KEYS", "HFConfigError", "hf_family", "config_from_hf", "config_to_hf",
           "export_family"]

# model_type -> the causal-LM class that reads it
FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM",
            "glm4_moe": "Glm4MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
            "llama4_text": "Llama4ForCausalLM", "gpt_oss": "GptOssForCausalLM"}

# Keys that do not change what the network computes from token ids.
METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_router_logits", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
    "initializer_range", "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions",
    "tokenizer_class", "chunk_size_feed_forward",
})

_REQUIRED = object()


class HFConfigError(ValueError):
    """A Hugging Face config we cannot represent (import) or cannot write (export);
    ``problems`` holds one line per problem, each naming the key or field."""

    def __init__(self, problems: list[str], where: str):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{where}: {n} problem{'s' if n != 1 else ''}"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


def hf_family(hf: dict) -> str:
    """The family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``) of a parsed ``config.json``."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError([f"model_type={model_type!r} is not one of {', '.join(FAMILIES)}"],
                            "unsupported Hugging Face model")
    archs = hf.get("architectures")
    if archs is not None and list(archs) != [FAMILIES[model_type]]:
        raise HFConfigError([f"architectures={archs!r}: only [{FAMILIES[model_type]!r}] is supported for "
                             f"model_type={model_type!r}"], "unsupported Hugging Face model")
    return model_type


class _Keys:
    """Reads keys of ``config.json``, remembering which were looked at."""

    def __init__(self, hf: dict, family: str, problems: list[str]):
        self.hf, self.family, self.problems = hf, family, problems
        self.used = set(METADATA_KEYS)

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        self.used.add(key)
        value = self.hf.get(key)
        if value is not None:
            return value
        if default is _REQUIRED:
            self.problems.append(f"{key} is missing (required for {self.family})")
        return default

    def must_be(self, key: str, allowed: tuple, why: str) -> None:
        value = self.get(key, allowed[0])
        if value not in allowed:
            self.problems.append(f"{key}={value!r} is not supported: {why}")

    def unknown(self) -> list[str]:
        # A key set to null is not set.
        return sorted(k for k, v in self.hf.items() if k not in self.used and not k.startswith("_") and v is not None)


def _rope_theta(keys: _Keys, default: float, partial_rotary: bool = False) -> float:
    """rope theta from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``
    (4.x). ``partial_rotary``: the family reads ``partial_rotary_factor`` itself (GLM-4.5);
    elsewhere a factor other than 1 is refused."""
    params = keys.get("rope_parameters", {})
    scaling = keys.get("rope_scaling", None)
    theta = keys.get("rope_theta", None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            keys.problems.append(f"rope_scaling={scaling!r} is not supported: rotary embeddings are unscaled here")
    if not isinstance(params, dict):
        keys.problems.append(f"rope_parameters={params!r} must be a mapping")
        params = {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        keys.problems.append(f"rope_parameters.rope_type={kind!r} is not supported: only 'default' rotary "
                             f"embeddings are implemented")
    extra = sorted(set(params) - {"rope_type", "rope_theta", "partial_rotary_factor"})
    if extra and kind == "default":
        keys.problems.append(f"rope_parameters sets {', '.join(extra)}, which default rotary embeddings do not have")
    for where, factor in (("rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor")),
                          ("partial_rotary_factor", keys.get("partial_rotary_factor", None))):
        if factor is not None and factor != 1.0 and not partial_rotary:
            keys.problems.append(f"{where}={factor!r} is not supported: rotary embeddings cover the whole head")
    return float(params.get("rope_theta", theta if theta is not None else default))


def _check_window(keys: _Keys, seq_length: int, sliding_layers: bool) -> None:
    window = keys.get("sliding_window", None)
    if sliding_layers and window is not None and window < seq_length:
        keys.problems.append(f"sliding_window={window} is smaller than model.seq_length={seq_length}: this importer "
                             f"does not map {keys.family}'s sliding window to model.sliding_window (a window >= the "
                             f"sequence is plain causal attention)")


def _num_experts(keys: _Keys, name: str, alias: str) -> Optional[int]:
    """The expert count under its family's name or the other one (transformers 5 writes
    Qwen3-MoE's as ``num_local_experts`` through its attribute map)."""
    value = keys.get(alias, None)
    return keys.get(name) if value is None else keys.get(name, value)


def _common_sizes(keys: _Keys, m, family: str, *, norm_eps: float = 1e-5, tie: bool = False) -> None:
    """The sizes every family names alike: vocabulary, width, layers and query heads (a
    config without them is refused at once: nothing else can be read), the norm's epsilon,
    tied embeddings and the init std (``norm_eps`` and ``tie``: the family's defaults)."""
    m.vocab_size = keys.get("vocab_size")
    m.hidden_size = keys.get("hidden_size")
    m.num_layers = keys.get("num_hidden_layers")
    m.num_heads = keys.get("num_attention_heads")
    if None in (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads):
        raise HFConfigError(keys.problems, f"cannot import {family} config")
    m.norm_eps = float(keys.get("rms_norm_eps", norm_eps))
    m.tie_embeddings = bool(keys.get("tie_word_embeddings", tie))
    m.init_std = float(keys.get("initializer_range", 0.02))


def _attention_heads(keys: _Keys, m, head_dim: Optional[int] = None) -> None:
    """Grouped-query attention's key/value heads (default: one per query head) and the
    head width (default ``head_dim``, else hidden_size / num_heads)."""
    m.num_kv_heads = keys.get("num_key_value_heads", m.num_heads)
    explicit = keys.get("head_dim", head_dim)
    m.head_dim = int(explicit) if explicit is not None else m.hidden_size // m.num_heads


def config_from_hf(hf: dict, base: Optional[Config] = None) -> Config:
    """Our Config for the Hugging Face config ``hf`` (a parsed ``config.json``).

    The architecture (``model`` fields but ``seq_length``; the ``moe`` fields that change
    the forward) comes from ``hf``; everything else (parallel layout, dispatcher,
    training, data) from ``base`` (default: ``Config()`` with ``model.seq_length`` set
    to ``max_position_embeddings``). Raises :class:`HFConfigError` listing every key we
    cannot represent."""
    family = hf_family(hf)
    problems: list[str] = []
    keys = _Keys(hf, family, problems)
    config = copy.deepcopy(base) if base is not None else Config()
    m, moe = config.model, config.moe
    if base is None:
        m.seq_length = int(keys.get("max_position_embeddings", m.seq_length))
    m.qk_norm_scope, m.partial_rotary_factor, m.mtp_num_layers = "head", 1.0, 0
    moe.topk_norm_min = None  # ERNIE-4.5's alone
    _reset_attention_features(config)
    # gpt-oss's features: none of a gpt-oss base config stays in another family.
    m.attention_out_bias, m.yarn_truncate = False, True
    moe.router_bias, moe.expert_linear_bias, moe.activation = False, False, "swiglu"
    if family in ("deepseek_v2", "deepseek_v3"):
        (_deepseek_v2_from_hf if family == "deepseek_v2" else _deepseek_v3_from_hf)(keys, config)
        return _finish(keys, family, config)
    # Standard attention, unscaled rotary: nothing of an MLA base config stays.
    m.attention, m.rope_interleave, m.rope_scaling = "mha", False, None
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 *_YARN_KEYS.values()):
        setattr(m, name, None)
    m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_truncate = 32.0, 1.0, True
    if family == "gpt_oss":
        _gpt_oss_from_hf(keys, config)
        return _finish(keys, family, config)
    if family == "glm4_moe":
        _glm4_moe_from_hf(keys, config)
        return _finish(keys, family, config)
    if family == "llama4_text":
        _llama4_text_from_hf(keys, config)
        return _finish(keys, family, config)
    if family == "ernie4_5_moe":
        _ernie4_5_moe_from_hf(keys, config)
        m.rope_interleave = True
        return _finish(keys, family, config)
    if family == "minimax_m2":
        _minimax_m2_from_hf(keys, config)
        return _finish(keys, family, config)

    _common_sizes(keys, m, family, norm_eps=1e-5 if family == "mixtral" else 1e-6)
    _attention_heads(keys, m)
    m.rope_theta = _rope_theta(keys, 1e6 if family == "mixtral" else 1e4)
    m.ffn_hidden_size = keys.get("intermediate_size")
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("mlp_bias", (False,), "the MLPs have no biases here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")

    moe.score_function, moe.num_groups, moe.group_topk, moe.group_score = "softmax", None, None, "topk_sum"
    moe.scaling_factor, moe.expert_bias, moe.first_k_dense = None, False, 0
    moe.topk = keys.get("num_experts_per_tok")
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.input_jitter = 0.0
    m.qk_norm, m.qkv_bias = family in ("qwen3_moe", "olmoe"), False
    if family == "olmoe":
        m.qk_norm_scope = "projection"
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False

    if family == "mixtral":
        moe.num_experts = _num_experts(keys, "num_local_experts", "num_experts")
        moe.ffn_hidden_size = m.ffn_hidden_size
        moe.moe_layer_freq = 1
        moe.pre_softmax = False
        moe.input_jitter = float(keys.get("router_jitter_noise", 0.0))
        # Mixtral slides every layer's window (i - j < sliding_window, as model.sliding_window);
        # a window covering model.seq_length changes nothing in training and stays unset.
        window = keys.get("sliding_window", None)
        if window is not None and window < m.seq_length:
            m.sliding_window = int(window)
    else:
        moe.num_experts = _num_experts(keys, "num_experts", "num_local_experts")
        # OLMoE's experts are its intermediate_size wide (every layer is MoE).
        moe.ffn_hidden_size = m.ffn_hidden_size if family == "olmoe" else keys.get("moe_intermediate_size")
        moe.pre_softmax = not keys.get("norm_topk_prob", False)
        step = keys.get("decoder_sparse_step", 1)
        dense = set(keys.get("mlp_only_layers", []))
        if isinstance(m.num_layers, int) and isinstance(step, int) and step >= 1:
            flags = [int(i not in dense and (moe.num_experts or 0) > 0 and (i + 1) % step == 0)
                     for i in range(m.num_layers)]
            moe.moe_layer_freq = 1 if all(flags) else flags
        else:
            problems.append(f"decoder_sparse_step={step!r} must be an integer >= 1")
        sliding = bool(keys.get("use_sliding_window", False))
        keys.get("max_window_layers", None)  # which layers slide: moot, any window is checked below
        layer_types = keys.get("layer_types", None)
        if layer_types is not None:
            odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
            if odd:
                problems.append(f"layer_types has {odd}: only full_attention and sliding_attention are known")
            sliding = sliding and "sliding_attention" in layer_types
        _check_window(keys, m.seq_length, sliding_layers=sliding)
        if family == "olmoe":
            keys.must_be("clip_qkv", (None,), "q, k and v are not clipped here")
        if family == "qwen2_moe":
            m.qkv_bias = bool(keys.get("qkv_bias", True))
            shared = keys.get("shared_expert_intermediate_size")
            if shared:
                moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = int(shared), True
        else:
            keys.must_be("attention_bias", (False,), "attention projections have no biases here (q|k|v bias is "
                                                     "Qwen2-MoE's qkv_bias; the output projection has none)")
    return _finish(keys, family, config)


def _reset_attention_features(config: Config) -> None:
    """Nothing of a base config's attention features or expert-input scaling stays: the
    importing family sets what it has."""
    m = config.model
    m.attention_sinks, m.sliding_window, m.attention_chunk = False, 0, 0
    m.local_attention_layers, m.rope_layers = None, None
    m.attn_temperature_tuning, m.attn_temperature_scale, m.attn_temperature_floor = False, 0.1, 8192
    config.moe.score_on_input = False


def _llama4_text_from_hf(keys: _Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    _common_sizes(keys, m, "llama4_text")
    L = m.num_layers
    _attention_heads(keys, m)
    m.rope_theta = _rope_theta(keys, 500000.0)  # refuses Scout's llama3 rope scaling
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


def _finish(keys: _Keys, family: str, config: Config) -> Config:
    """Refuse the keys nobody read, then every problem found."""
    unknown = keys.unknown()
    if unknown:
        keys.problems.append(f"{', '.join(unknown)}: not understood by moe-fold's {family} importer "
                             f"(a setting it cannot represent is refused rather than ignored)")
    if keys.problems:
        raise HFConfigError(keys.problems, f"cannot import {family} config")
    return config


_YARN_KEYS = {"factor": "yarn_factor", "original_max_position_embeddings": "yarn_original_max_position_embeddings",
              "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
              "mscale_all_dim": "yarn_mscale_all_dim"}


def _deepseek_rope(keys: _Keys, m) -> None:
    """``rope_parameters`` (or 4.x ``rope_theta``/``rope_scaling``): default or YaRN."""
    params = dict(keys.get("rope_parameters", {}) or {})
    scaling = keys.get("rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    theta = keys.get("rope_theta", None)
    m.rope_theta = float(params.pop("rope_theta", theta if theta is not None else 10000.0))
    kind = params.pop("rope_type", "default")
    m.rope_scaling = None
    for field in _YARN_KEYS.values():
        setattr(m, field, None)
    m.yarn_beta_fast, m.yarn_beta_slow = 32.0, 1.0
    m.yarn_truncate = True
    if kind == "yarn":
        m.rope_scaling = "yarn"
        # false (gpt-oss): the correction range keeps its fractional ends.
        m.yarn_truncate = bool(params.pop("truncate", True))
        if params.get("attention_factor") is not None:
            keys.problems.append(f"rope_parameters.attention_factor={params['attention_factor']!r} is not "
                                 f"supported: the attention factor is derived from factor, mscale and mscale_all_dim")
        params.pop("attention_factor", None)
        for theirs, ours in _YARN_KEYS.items():
            value = params.pop(theirs, None)
            if value is not None:
                setattr(m, ours, int(value) if ours.endswith("embeddings") else float(value))
        if m.yarn_factor is None and m.yarn_original_max_position_embeddings:
            m.yarn_factor = float(keys.get("max_position_embeddings")) / m.yarn_original_max_position_embeddings
    elif kind != "default":
        keys.problems.append(f"rope_parameters.rope_type={kind!r} is not supported for {keys.family}: only "
                             f"'default' and 'yarn'")
    if params.get("partial_rotary_factor", 1.0) in (None, 1.0):
        params.pop("partial_rotary_factor", None)
    if params:
        keys.problems.append(f"rope_parameters sets {', '.join(sorted(params))}, which {kind} rotary embeddings "
                             f"here do not have")


def _mla_from_hf(keys: _Keys, config: Config, family: str) -> None:
    """The sizes and rotary embeddings of multi-head latent attention (DeepSeek-V2 and -V3)."""
    m = config.model
    _common_sizes(keys, m, family, norm_eps=1e-6)
    kv_heads = keys.get("num_key_value_heads", m.num_heads)
    if kv_heads != m.num_heads:
        keys.problems.append(f"num_key_value_heads={kv_heads} must equal num_attention_heads={m.num_heads}: MLA "
                             f"gives every head its own key and value")
    m.num_kv_heads, m.head_dim = m.num_heads, None
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.qk_norm, m.qkv_bias = False, False
    m.attention = "mla"
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
    _deepseek_rope(keys, m)
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


def _deepseek_v3_from_hf(keys: _Keys, config: Config) -> None:
    _mla_from_hf(keys, config, "deepseek_v3")
    config.model.rope_interleave = bool(keys.get("rope_interleave", True))
    keys.must_be("scoring_func", ("sigmoid",), "DeepSeek-V3 routes with sigmoid scores")
    keys.must_be("topk_method", ("noaux_tc",), "routing is group-limited top-k with the score correction bias")
    keys.must_be("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE")
    _deepseek_moe_from_hf(keys, config)


def _deepseek_v2_from_hf(keys: _Keys, config: Config) -> None:
    """DeepSeek-V2 and V2-Lite: MLA with interleaved rotary pairs always (DeepseekV2 rotates
    them as complex numbers); softmax over all experts, top-k of those probabilities as they
    are (our ``pre_softmax: true``), times ``routed_scaling_factor``; ``greedy`` top-k, or
    ``group_limited_greedy``: the ``topk_group`` groups with the highest single score first
    (``moe.group_score: max``); ungated shared experts; the first layers dense."""
    m, moe = config.model, config.moe
    _mla_from_hf(keys, config, "deepseek_v2")
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
        experts = moe.num_experts or 0
        reachable = (group_topk or 0) * (experts // groups)
        if experts and moe.topk is not None and moe.topk > reachable:
            keys.problems.append(f"num_experts_per_tok={moe.topk} with topk_group={group_topk} is not supported: "
                                 f"the {group_topk} selected groups hold {reachable} experts (n_routed_experts/"
                                 f"n_group={experts // groups} each), and transformers would fill the rest with "
                                 f"experts of the excluded groups")
    elif method not in ("greedy", "group_limited_greedy"):
        keys.problems.append(f"topk_method={method!r} is not supported for deepseek_v2: 'greedy' or "
                             f"'group_limited_greedy'")


def _deepseek_moe_from_hf(keys: _Keys, config: Config) -> None:
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
        experts = moe.num_experts or 0
        reachable = (group_topk or 0) * (experts // groups)
        if experts and groups and moe.topk is not None and moe.topk > reachable:
            keys.problems.append(f"num_experts_per_tok={moe.topk} with topk_group={group_topk} is not supported: "
                                 f"the {group_topk} selected groups hold {reachable} experts (n_routed_experts/"
                                 f"n_group={experts // groups} each), and transformers would fill the rest with "
                                 f"experts of the excluded groups")


def _glm4_moe_from_hf(keys: _Keys, config: Config) -> None:
    m = config.model
    _common_sizes(keys, m, "glm4_moe")
    _attention_heads(keys, m)
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.qkv_bias = bool(keys.get("attention_bias", False))
    m.qk_norm = bool(keys.get("use_qk_norm", False))
    params = keys.get("rope_parameters", {})
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    # transformers' Glm4MoeConfig defaults the factor to 0.5 when neither place sets it.
    m.partial_rotary_factor = float(inner if inner is not None else keys.get("partial_rotary_factor", 0.5))
    m.rope_theta = _rope_theta(keys, 1e4, partial_rotary=True)
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    coeff = keys.get("router_aux_loss_coef", None)
    if coeff is not None:
        config.moe.aux_loss_coeff = float(coeff)
    _deepseek_moe_from_hf(keys, config)


def _ernie4_5_moe_from_hf(keys: _Keys, config: Config) -> None:
    """ERNIE-4.5-MoE: grouped-query attention with interleaved rotary pairs; layer ``i`` is
    MoE when ``(i + 1) % moe_layer_interval == 0`` and ``moe_layer_start_index <= i <=
    moe_layer_end_index`` (-1: the last layer); softmax over all experts, the expert bias
    (``moe_statics.e_score_correction_bias``) added for selection only, the k chosen softmax
    values divided by max(their sum, ``moe_norm_min``) (our ``pre_softmax``, ``expert_bias``
    and ``topk_norm_min``); ungated shared experts of ``moe_intermediate_size`` each."""
    m, moe = config.model, config.moe
    _common_sizes(keys, m, "ernie4_5_moe", tie=True)
    _attention_heads(keys, m)
    m.ffn_hidden_size = keys.get("intermediate_size")
    m.rope_theta = _rope_theta(keys, 5e5)
    m.qk_norm, m.qkv_bias = False, False
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("use_bias", (False,), "ERNIE-4.5's use_bias puts biases on every linear (q, k, v, o and the "
                                       "MLPs); moe-fold has q|k|v biases only")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    moe.num_experts = _num_experts(keys, "moe_num_experts", "num_experts")
    topk = keys.get("num_experts_per_tok", None)
    moe.topk = keys.get("moe_k") if topk is None else keys.get("moe_k", topk)
    moe.ffn_hidden_size = keys.get("moe_intermediate_size")
    moe.shared_expert_ffn_hidden_size = int(keys.get("moe_num_shared_experts", 0)) * int(moe.ffn_hidden_size or 0)
    moe.shared_expert_gate = False
    moe.score_function, moe.pre_softmax, moe.expert_bias, moe.input_jitter = "softmax", True, True, 0.0
    moe.topk_norm_min = float(keys.get("moe_norm_min", 1e-12))
    moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor = None, None, "topk_sum", None
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.first_k_dense = 0
    start, end = keys.get("moe_layer_start_index", 1), keys.get("moe_layer_end_index", -1)
    interval = keys.get("moe_layer_interval", 1)
    if not (isinstance(interval, int) and interval >= 1):
        keys.problems.append(f"moe_layer_interval={interval!r} must be an integer >= 1")
        return
    end = m.num_layers - 1 if end == -1 else end
    flags = [int((i + 1) % interval == 0 and start <= i <= end) for i in range(m.num_layers)]
    moe.moe_layer_freq = 1 if all(flags) else flags


def _minimax_m2_from_hf(keys: _Keys, config: Config) -> None:
    """MiniMax-M2: grouped-query attention with an RMSNorm over the whole q and k
    projections (our ``qk_norm_scope: projection``, as OLMoE) and rotary embeddings on the
    first ``rotary_dim`` dims of each head (``partial_rotary_factor``); every layer MoE:
    sigmoid scores, the expert bias (``e_score_correction_bias``) added for selection only,
    the k chosen renormalised; no shared expert."""
    m, moe = config.model, config.moe
    _common_sizes(keys, m, "minimax_m2", norm_eps=1e-6)
    _attention_heads(keys, m, head_dim=128)  # MiniMaxM2Config's default, not hidden/heads
    m.qk_norm, m.qk_norm_scope, m.qkv_bias = True, "projection", False
    params = keys.get("rope_parameters", {})
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    rotary = keys.get("rotary_dim", None)
    from_dim = rotary / m.head_dim if rotary is not None else None
    m.partial_rotary_factor = float(inner if inner is not None else from_dim if from_dim is not None else 1.0)
    if inner is not None and from_dim is not None and inner != from_dim:
        keys.problems.append(f"rotary_dim={rotary} disagrees with rope_parameters.partial_rotary_factor={inner} "
                             f"of head_dim={m.head_dim}")
    m.rope_theta = _rope_theta(keys, 5e6, partial_rotary=True)
    keys.must_be("hidden_act", ("silu",), "the experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    # Keys of the original (remote-code) config.json, where they say what transformers computes.
    keys.must_be("use_qk_norm", (True,), "MiniMax-M2 normalises q and k")
    keys.must_be("qk_norm_type", ("per_layer",), "the QK-norm spans the whole q and k projections")
    keys.must_be("scoring_func", ("sigmoid",), "MiniMax-M2 routes with sigmoid scores")
    keys.must_be("use_routing_bias", (True,), "the router always has its score correction bias")
    moe.num_experts = _num_experts(keys, "num_local_experts", "num_experts")
    moe.topk = keys.get("num_experts_per_tok")
    moe.ffn_hidden_size = m.ffn_hidden_size = keys.get("intermediate_size")
    moe.moe_layer_freq, moe.first_k_dense = 1, 0
    moe.score_function, moe.pre_softmax, moe.expert_bias = "sigmoid", False, True
    moe.num_groups, moe.group_topk, moe.group_score, moe.scaling_factor = None, None, "topk_sum", None
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False
    moe.input_jitter = float(keys.get("router_jitter_noise", 0.0))
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    if moe.topk == 1:
        keys.problems.append("num_experts_per_tok=1 is not supported: MiniMax-M2 renormalises the top-k sigmoid "
                             "scores (a weight of 1 for k=1), moe-fold renormalises for k > 1 only")


def _minimax_m2_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m, moe = config.model, config.moe
    refuse(not (m.qk_norm and m.qk_norm_scope == "projection"),
           f"model.qk_norm={str(m.qk_norm).lower()}, model.qk_norm_scope={m.qk_norm_scope}: MiniMax-M2 normalises "
           f"the whole q and k projections")
    refuse(m.qkv_bias, "model.qkv_bias=true: MiniMax-M2 has no q|k|v biases")
    refuse(moe.score_function != "sigmoid", f"moe.score_function={moe.score_function}: MiniMax-M2 routes with "
                                            f"sigmoid scores")
    refuse(not moe.expert_bias, "moe.expert_bias=false: MiniMax-M2's router always has its score correction bias")
    refuse(moe.topk < 2, f"moe.topk={moe.topk}: MiniMax-M2 renormalises the top-k sigmoid scores, which moe-fold "
                         f"does only for k > 1")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: MiniMax-M2 has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: MiniMax-M2 does not scale "
                                           f"probs")
    refuse(moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: MiniMax-M2 has no shared expert")
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every MiniMax-M2 layer is MoE")
    if problems:
        raise HFConfigError(problems, "cannot export to minimax_m2")
    return {
        "architectures": [FAMILIES["minimax_m2"]], "model_type": "minimax_m2", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": moe.ffn_hidden_size, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "router_aux_loss_coef": moe.aux_loss_coeff, "router_jitter_noise": moe.input_jitter,
    }


def _ernie_layer_pattern(flags: list[bool]) -> Optional[tuple[int, int, int]]:
    """(start, end, interval) of ERNIE-4.5 that gives the MoE layers ``flags``, None if none does."""
    moe = [i for i, f in enumerate(flags) if f]
    if not moe:
        return None
    for interval in range(1, len(flags) + 1):
        if [bool((i + 1) % interval == 0 and moe[0] <= i <= moe[-1]) for i in range(len(flags))] == list(flags):
            return moe[0], moe[-1], interval
    return None


def _ernie4_5_moe_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m, moe = config.model, config.moe
    refuse(m.qk_norm, "model.qk_norm=true: ERNIE-4.5 has no QK-norm")
    refuse(m.qkv_bias, "model.qkv_bias=true: ERNIE-4.5's use_bias would put biases on o and the MLPs too")
    refuse(not m.rope_interleave, "model.rope_interleave=false: ERNIE-4.5 rotates interleaved pairs")
    refuse(moe.score_function != "softmax" or not moe.pre_softmax,
           f"moe.score_function={moe.score_function}, moe.pre_softmax={str(moe.pre_softmax).lower()}: ERNIE-4.5 "
           f"takes the top-k of the softmax over all experts (pre_softmax)")
    refuse(not moe.expert_bias, "moe.expert_bias=false: ERNIE-4.5's router always has its score correction bias")
    refuse(moe.topk_norm_min is None, "moe.topk_norm_min=null: ERNIE-4.5 always renormalises the top-k "
                                      "(over max(sum, moe_norm_min))")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: ERNIE-4.5 has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: ERNIE-4.5 does not scale probs")
    refuse(moe.shared_expert_gate, "moe.shared_expert_gate=true: ERNIE-4.5's shared experts are not gated")
    refuse(moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size != 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: there are n >= 0 shared "
           f"experts of width moe.ffn_hidden_size={moe.ffn_hidden_size}")
    pattern = _ernie_layer_pattern(flags)
    refuse(pattern is None, f"moe layer pattern {[int(f) for f in flags]}: ERNIE-4.5's MoE layers are every "
                            f"moe_layer_interval-th layer between a start and an end layer")
    if problems:
        raise HFConfigError(problems, "cannot export to ernie4_5_moe")
    start, end, interval = pattern
    return {
        "architectures": [FAMILIES["ernie4_5_moe"]], "model_type": "ernie4_5_moe", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": m.ffn_hidden_size, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "use_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "moe_num_experts": moe.num_experts, "moe_k": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size,
        "moe_num_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "moe_layer_start_index": start, "moe_layer_end_index": end, "moe_layer_interval": interval,
        "moe_norm_min": moe.topk_norm_min, "router_aux_loss_coef": moe.aux_loss_coeff,
    }


def _gpt_oss_attention_from_hf(keys: _Keys, m) -> None:
    """gpt-oss's attention features: sinks on every layer, a sliding window of
    ``sliding_window`` keys (the query's own included) on the ``sliding_attention`` layers
    of ``layer_types`` (transformers' default: the even layers)."""
    m.attention_sinks = True
    layer_types = keys.get("layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(m.num_layers)]
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        keys.problems.append(f"layer_types has {odd}: only full_attention and sliding_attention are known")
    if len(layer_types) != m.num_layers:
        keys.problems.append(f"layer_types has {len(layer_types)} entries for num_hidden_layers={m.num_layers}")
    window = keys.get("sliding_window", None)
    flags = [int(kind == "sliding_attention") for kind in layer_types]
    if window is None or not any(flags):
        m.sliding_window, m.local_attention_layers = 0, None
    else:
        m.sliding_window = int(window)
        m.local_attention_layers = None if all(flags) else flags


def _gpt_oss_from_hf(keys: _Keys, config: Config) -> None:
    """gpt-oss: grouped-query attention with biases on q, k, v and o, attention sinks, a
    sliding window on the ``sliding_attention`` layers, YaRN rotary (not truncated); every
    layer MoE, a router with bias (softmax over the top-k logits), experts with biases and
    the clamped SwiGLU. MXFP4-quantized checkpoints (``quantization_config``) are refused."""
    m, moe = config.model, config.moe
    quant = keys.get("quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        keys.problems.append(f"quantization_config (quant_method={method!r}) is not supported: moe-fold reads "
                             f"bfloat16/float32 gpt-oss checkpoints only; dequantize first (transformers: "
                             f"from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)), then "
                             f"save_pretrained)")
    _common_sizes(keys, m, "gpt_oss")
    _attention_heads(keys, m)
    m.qk_norm, m.partial_rotary_factor = False, 1.0
    # attention_bias covers all four projections here (q|k|v and o).
    m.qkv_bias = m.attention_out_bias = bool(keys.get("attention_bias", True))
    _deepseek_rope(keys, m)
    _gpt_oss_attention_from_hf(keys, m)
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    # The experts' activation is the clamped SwiGLU whatever hidden_act says (transformers ignores it too).
    keys.get("hidden_act", None)
    moe.num_experts = _num_experts(keys, "num_local_experts", "num_experts")
    moe.topk = keys.get("num_experts_per_tok")
    moe.ffn_hidden_size = keys.get("intermediate_size")
    m.ffn_hidden_size = moe.ffn_hidden_size  # no dense layers; kept equal for a tidy config
    moe.moe_layer_freq, moe.first_k_dense = 1, 0
    moe.score_function, moe.pre_softmax, moe.num_groups, moe.group_topk = "softmax", False, None, None
    moe.group_score, moe.scaling_factor, moe.expert_bias, moe.input_jitter = "topk_sum", None, False, 0.0
    moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False
    moe.aux_loss_coeff = float(keys.get("router_aux_loss_coef", 0.001))
    moe.router_bias, moe.expert_linear_bias, moe.activation = True, True, "clamped_swiglu"
    moe.swiglu_alpha = float(keys.get("swiglu_alpha", 1.702))
    moe.swiglu_limit = float(keys.get("swiglu_limit", 7.0))


def export_family(config: Config) -> str:
    """The family a model of ``config`` exports to: DeepSeek-V2 with MLA and softmax routing,
    DeepSeek-V3 with MLA and sigmoid, ERNIE-4.5 with interleaved rotary pairs, a softmax
    expert bias or a top-k renormalisation floor, MiniMax-M2 with a QK-norm over the
    projections and sigmoid routing, OLMoE with a
    QK-norm over the projections, GLM-4.5 with an expert bias, partial rotary or MTP,
    Qwen3-MoE with QK-norm, Qwen2-MoE with a shared expert or q|k|v biases, Llama-4 with
    expert-input scaling, chunked attention or the L2 QK-norm, else Mixtral."""
    m, moe = config.model, config.moe
    if m.attention == "mla":
        return "deepseek_v2" if moe.score_function == "softmax" else "deepseek_v3"
    if moe.score_on_input or m.attention_chunk or (m.qk_norm and m.qk_norm_scope == "l2"):
        return "llama4_text"
    if moe.router_bias or moe.expert_linear_bias or moe.activation == "clamped_swiglu" or m.attention_sinks:
        return "gpt_oss"
    if m.rope_interleave or moe.topk_norm_min is not None or (moe.expert_bias and moe.score_function == "softmax"):
        return "ernie4_5_moe"
    if m.qk_norm and m.qk_norm_scope == "projection":
        return "minimax_m2" if moe.score_function == "sigmoid" else "olmoe"
    if moe.expert_bias or m.partial_rotary_factor != 1.0 or m.mtp_num_layers > 0:
        return "glm4_moe"
    if m.qk_norm:
        return "qwen3_moe"
    if moe.shared_expert_ffn_hidden_size > 0 or m.qkv_bias:
        return "qwen2_moe"
    return "mixtral"


def config_to_hf(config: Config, family: Optional[str] = None, dtype: str = "float32") -> dict:
    """The ``config.json`` of ``family`` (default :func:`export_family`) for a model of
    ``config``; raises :class:`HFConfigError` naming each field that family cannot hold."""
    family = family or export_family(config)
    if family not in FAMILIES:
        raise HFConfigError([f"family={family!r} is not one of {', '.join(FAMILIES)}"], "cannot export")
    m, moe = config.model, config.moe
    flags = moe_layer_flags(config)
    problems = []

    def refuse(condition: bool, text: str) -> None:
        if condition:
            problems.append(text)

    refuse(family not in ("deepseek_v2", "deepseek_v3") and m.attention == "mla",
           f"model.attention=mla: {family} has standard attention (DeepSeek-V2 and -V3 have MLA)")
    refuse(family not in ("glm4_moe", "olmoe", "minimax_m2", "llama4_text") and m.qk_norm and m.qk_norm_scope != "head",
           f"model.qk_norm_scope={m.qk_norm_scope}: {family} normalises each head (OLMoE normalises the whole "
           f"projections)")
    refuse(family not in ("glm4_moe", "minimax_m2") and m.partial_rotary_factor != 1.0,
           f"model.partial_rotary_factor={m.partial_rotary_factor}: {family} rotates the whole head (GLM-4.5 "
           f"and MiniMax-M2 rotate a part)")
    refuse(family not in ("deepseek_v3", "glm4_moe") and m.mtp_num_layers > 0,
           f"model.mtp_num_layers={m.mtp_num_layers}: {family} has no multi-token prediction (DeepSeek-V3 and "
           f"GLM-4.5 have)")
    refuse(family not in ("deepseek_v2", "deepseek_v3", "ernie4_5_moe", "llama4_text") and m.rope_interleave,
           f"model.rope_interleave=true: {family} rotates two halves of each head (DeepSeek, ERNIE-4.5 and Llama-4 "
           f"rotate interleaved pairs)")
    refuse(family != "ernie4_5_moe" and moe.topk_norm_min is not None,
           f"moe.topk_norm_min={moe.topk_norm_min}: {family} has no renormalisation floor (ERNIE-4.5's moe_norm_min)")
    # gpt-oss's features: refused by every other family.
    if family != "gpt_oss":
        refuse(moe.router_bias, f"moe.router_bias=true: {family}'s router has no bias (gpt-oss's has)")
        refuse(moe.expert_linear_bias, f"moe.expert_linear_bias=true: {family}'s experts have no biases (gpt-oss's "
                                       f"have)")
        refuse(moe.activation != "swiglu", f"moe.activation={moe.activation}: {family}'s experts are plain SwiGLU")
        refuse(m.attention_out_bias, f"model.attention_out_bias=true: {family}'s output projection has no bias "
                                     f"(gpt-oss's has)")
        refuse(m.rope_scaling == "yarn" and family not in ("deepseek_v2", "deepseek_v3"),
               f"model.rope_scaling=yarn: {family} has unscaled rotary embeddings here")
    if family == "gpt_oss":
        return _gpt_oss_to_hf(config, flags, refuse, problems, dtype)
    if family == "llama4_text":
        return _llama4_text_to_hf(config, flags, refuse, problems, dtype)
    # The attention features and expert-input scaling: only Llama-4 and gpt-oss (above) hold them.
    for name, off in (("attention_sinks", False), ("sliding_window", 0), ("attention_chunk", 0),
                      ("rope_layers", None), ("attn_temperature_tuning", False)):
        if not (name == "sliding_window" and family == "mixtral"):
            refuse(getattr(m, name) != off, f"model.{name}={getattr(m, name)!r}: {family} has no such attention "
                                            f"setting")
    refuse(moe.score_on_input, f"moe.score_on_input=true: {family} scales each expert's output by its prob")
    if family == "deepseek_v3":
        return _deepseek_v3_to_hf(config, flags, refuse, problems, dtype)
    if family == "deepseek_v2":
        return _deepseek_v2_to_hf(config, flags, refuse, problems, dtype)
    if family == "ernie4_5_moe":
        return _ernie4_5_moe_to_hf(config, flags, refuse, problems, dtype)
    if family == "minimax_m2":
        return _minimax_m2_to_hf(config, flags, refuse, problems, dtype)
    if family == "glm4_moe":
        return _glm4_moe_to_hf(config, flags, refuse, problems, dtype)

    refuse(moe.score_function != "softmax", f"moe.score_function={moe.score_function}: Hugging Face {family} routes "
                                            f"with softmax")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: {family} has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: {family} does not scale probs")
    refuse(moe.expert_bias, f"moe.expert_bias=true: {family} has no expert bias")
    refuse(moe.shared_expert_ffn_hidden_size > 0 and not moe.shared_expert_gate,
           "moe.shared_expert_gate=false with a shared expert: Hugging Face's shared expert is always gated")
    refuse(family not in ("qwen3_moe", "olmoe") and m.qk_norm,
           f"model.qk_norm=true: {family} has no QK-norm (Qwen3-MoE and OLMoE have)")
    refuse(family in ("qwen3_moe", "olmoe") and not m.qk_norm,
           f"model.qk_norm=false: {family} always normalises q and k")
    refuse(family == "olmoe" and m.qk_norm and m.qk_norm_scope != "projection",
           f"model.qk_norm_scope={m.qk_norm_scope}: OLMoE normalises the whole q and k projections")
    refuse(family != "qwen2_moe" and m.qkv_bias, f"model.qkv_bias=true: {family} has no q|k|v biases (Qwen2-MoE has)")
    refuse(family != "qwen2_moe" and moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: {family} has no shared expert")
    refuse(family == "qwen2_moe" and moe.shared_expert_ffn_hidden_size == 0,
           "moe.shared_expert_ffn_hidden_size=0: Qwen2-MoE always has a (gated) shared expert")
    if family == "olmoe":
        refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every OLMoE layer is MoE")
        refuse(head_dim(config) * m.num_heads != m.hidden_size,
               f"head_dim={head_dim(config)}: OLMoE's heads span model.hidden_size={m.hidden_size} exactly")
    if family == "mixtral":
        refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every Mixtral layer is MoE")
        refuse(m.local_attention_layers is not None,
               f"model.local_attention_layers={m.local_attention_layers}: Mixtral's sliding window is on every layer")
        refuse(moe.pre_softmax, "moe.pre_softmax=true: Mixtral renormalises the top-k probabilities")
    if problems:
        raise HFConfigError(problems, f"cannot export to {family}")

    hf: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family, "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": m.ffn_hidden_size if family != "mixtral" else moe.ffn_hidden_size,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "num_experts_per_tok": moe.topk, "router_aux_loss_coef": moe.aux_loss_coeff,
    }
    if family == "mixtral":
        hf.update(num_local_experts=moe.num_experts, router_jitter_noise=moe.input_jitter,
                  sliding_window=m.sliding_window or None)
        return hf
    hf.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
              norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=[i for i, f in enumerate(flags) if not f], use_sliding_window=False)
    if family == "qwen2_moe":
        hf.update(qkv_bias=m.qkv_bias, shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
    elif family == "olmoe":
        for key in ("head_dim", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window",
                    "moe_intermediate_size"):
            del hf[key]
        hf.update(intermediate_size=moe.ffn_hidden_size, attention_bias=False, clip_qkv=None)
    else:
        hf.update(attention_bias=False)
    return hf


def _rope_to_hf(m) -> dict:
    """``rope_parameters``: default, or YaRN with its keys (``truncate`` only when false)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope["rope_type"] = "yarn"
        rope.update({theirs: getattr(m, ours) for theirs, ours in _YARN_KEYS.items()
                     if getattr(m, ours) is not None})
        if not m.yarn_truncate:
            rope["truncate"] = False
    return rope


def _gpt_oss_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m, moe = config.model, config.moe
    refuse(m.qk_norm, "model.qk_norm=true: gpt-oss has no QK-norm")
    refuse(m.qkv_bias != m.attention_out_bias,
           f"model.qkv_bias={m.qkv_bias} with model.attention_out_bias={m.attention_out_bias}: gpt-oss's "
           f"attention_bias sets both")
    refuse(not m.attention_sinks, "model.attention_sinks=false: gpt-oss's attention always has sinks")
    refuse(m.attention_chunk > 0, f"model.attention_chunk={m.attention_chunk}: gpt-oss has no chunked attention")
    refuse(m.rope_layers is not None, "model.rope_layers is set: every gpt-oss layer has rotary embeddings")
    refuse(m.attn_temperature_tuning, "model.attn_temperature_tuning=true: gpt-oss has no temperature tuning")
    refuse(m.rope_interleave, "model.rope_interleave=true: gpt-oss rotates two halves of each head")
    refuse(moe.score_on_input, "moe.score_on_input=true: gpt-oss scales each expert's output by its prob")
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every gpt-oss layer is MoE")
    refuse(moe.score_function != "softmax" or moe.pre_softmax,
           f"moe.score_function={moe.score_function}, moe.pre_softmax={moe.pre_softmax}: gpt-oss takes the softmax "
           f"of the top-k logits (softmax, pre_softmax=false)")
    refuse(moe.num_groups is not None, f"moe.num_groups={moe.num_groups}: gpt-oss has no group-limited routing")
    refuse(moe.scaling_factor is not None, f"moe.scaling_factor={moe.scaling_factor}: gpt-oss does not scale probs")
    refuse(moe.expert_bias, "moe.expert_bias=true: gpt-oss's router has a learned bias, not an expert bias")
    refuse(moe.shared_expert_ffn_hidden_size > 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: gpt-oss has no shared expert")
    refuse(not moe.router_bias, "moe.router_bias=false: gpt-oss's router always has a bias")
    refuse(not moe.expert_linear_bias, "moe.expert_linear_bias=false: gpt-oss's experts always have biases")
    refuse(moe.activation != "clamped_swiglu",
           f"moe.activation={moe.activation}: gpt-oss's experts use the clamped SwiGLU")
    if problems:
        raise HFConfigError(problems, "cannot export to gpt_oss")
    local = [bool(f) for f in (m.local_attention_layers or [1] * m.num_layers)]
    sliding = m.sliding_window > 0
    return {
        "architectures": [FAMILIES["gpt_oss"]], "model_type": "gpt_oss", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "intermediate_size": moe.ffn_hidden_size, "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        "max_position_embeddings": m.seq_length, "attention_dropout": 0.0, "attention_bias": m.qkv_bias,
        "rope_parameters": _rope_to_hf(m),
        "layer_types": ["sliding_attention" if sliding and f else "full_attention" for f in local],
        "sliding_window": m.sliding_window if sliding else None,
        "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }


def _llama4_text_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m, moe = config.model, config.moe
    rope = [1] * m.num_layers if m.rope_layers is None else list(m.rope_layers)
    local = [1] * m.num_layers if m.local_attention_layers is None else list(m.local_attention_layers)
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
    if problems:
        raise HFConfigError(problems, "cannot export to llama4_text")
    chunked = [bool(m.attention_chunk) and f == 1 for f in local]
    return {
        "architectures": [FAMILIES["llama4_text"]], "model_type": "llama4_text", "dtype": dtype,
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


def _deepseek_moe_to_hf(config: Config, flags: list[bool], refuse) -> dict:
    """The config.json keys of DeepSeek-V3's MoE layers and MTP (GLM-4.5's too)."""
    m, moe = config.model, config.moe
    k = moe.first_k_dense
    refuse(moe.score_function != "sigmoid", f"moe.score_function={moe.score_function}: DeepSeek-V3 and GLM-4.5 "
                                            f"route with sigmoid scores")
    refuse(not moe.expert_bias, "moe.expert_bias=false: the router always has its score correction bias")
    refuse(moe.shared_expert_gate, "moe.shared_expert_gate=true: the shared experts are not gated")
    refuse(moe.shared_expert_ffn_hidden_size == 0 or moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size != 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: there are n >= 1 shared "
           f"experts of width moe.ffn_hidden_size={moe.ffn_hidden_size}")
    refuse(flags != [i >= k for i in range(m.num_layers)],
           f"moe layer pattern {[int(f) for f in flags]}: the first first_k_dense={k} layers are dense and every "
           f"later layer MoE")
    refuse(moe.topk < 2, f"moe.topk={moe.topk}: the top-k sigmoid probabilities are renormalised, which "
                         f"moe-fold does only for k > 1")
    ranked = None if moe.num_groups is None else group_ranked_scores(moe.group_score, moe.topk, moe.group_topk)
    refuse(ranked not in (None, 2),
           f"moe.group_score={moe.group_score} with moe.topk={moe.topk} and moe.group_topk={moe.group_topk}: "
           f"DeepSeek-V3 and GLM-4.5 rank a group by the sum of its best 2 scores, this model by its best "
           f"{ranked} (group_score=top2_sum, or topk_sum with topk = 2 * group_topk, can be exported)")
    return {
        "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "first_k_dense_replace": k, "norm_topk_prob": True,
        "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


def _deepseek_v3_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m = config.model
    refuse(m.attention != "mla", "model.attention=mha: DeepSeek-V3 has multi-head latent attention")
    moe_keys = _deepseek_moe_to_hf(config, flags, refuse)
    if problems:
        raise HFConfigError(problems, "cannot export to deepseek_v3")
    return {
        "architectures": [FAMILIES["deepseek_v3"]], "model_type": "deepseek_v3", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": m.rope_interleave,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False, "rope_parameters": _mla_rope(m), **moe_keys,
    }


def _mla_rope(m) -> dict:
    """``rope_parameters`` of an MLA model: default or YaRN."""
    rope = _rope_to_hf(m)
    return rope


def _deepseek_v2_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m, moe = config.model, config.moe
    k = moe.first_k_dense
    refuse(m.attention != "mla", "model.attention=mha: DeepSeek-V2 has multi-head latent attention")
    refuse(not m.rope_interleave, "model.rope_interleave=false: DeepSeek-V2 rotates interleaved pairs")
    refuse(moe.score_function != "softmax", f"moe.score_function={moe.score_function}: DeepSeek-V2 routes with a "
                                            f"softmax over all experts")
    refuse(not moe.pre_softmax, "moe.pre_softmax=false: DeepSeek-V2 keeps the top-k of the softmax over all "
                                "experts as they are (transformers never renormalises them)")
    refuse(moe.expert_bias, "moe.expert_bias=true: DeepSeek-V2's router has no expert bias")
    refuse(moe.shared_expert_gate, "moe.shared_expert_gate=true: the shared experts are not gated")
    refuse(moe.shared_expert_ffn_hidden_size == 0 or moe.shared_expert_ffn_hidden_size % moe.ffn_hidden_size != 0,
           f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: there are n >= 1 shared "
           f"experts of width moe.ffn_hidden_size={moe.ffn_hidden_size}")
    refuse(flags != [i >= k for i in range(m.num_layers)],
           f"moe layer pattern {[int(f) for f in flags]}: the first first_k_dense={k} layers are dense and every "
           f"later layer MoE")
    ranked = None if moe.num_groups is None else group_ranked_scores(moe.group_score, moe.topk, moe.group_topk)
    refuse(ranked not in (None, 1),
           f"moe.group_score={moe.group_score} with moe.topk={moe.topk} and moe.group_topk={moe.group_topk}: "
           f"DeepSeek-V2 ranks a group by its best score, this model by the sum of its best {ranked} "
           f"(group_score=max, or topk_sum with topk = group_topk, can be exported)")
    if problems:
        raise HFConfigError(problems, "cannot export to deepseek_v2")
    return {
        "architectures": [FAMILIES["deepseek_v2"]], "model_type": "deepseek_v2", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": False, "mlp_bias": False, "rope_parameters": _mla_rope(m),
        "intermediate_size": m.ffn_hidden_size, "moe_intermediate_size": moe.ffn_hidden_size,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.topk,
        "n_shared_experts": moe.shared_expert_ffn_hidden_size // max(moe.ffn_hidden_size, 1),
        "first_k_dense_replace": k, "norm_topk_prob": False,
        "topk_method": "greedy" if moe.num_groups is None else "group_limited_greedy",
        "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.scaling_factor if moe.scaling_factor is not None else 1.0,
    }


def _glm4_moe_to_hf(config: Config, flags: list[bool], refuse, problems: list[str], dtype: str) -> dict:
    m = config.model
    refuse(m.qk_norm and m.qk_norm_scope != "head",
           f"model.qk_norm_scope={m.qk_norm_scope}: GLM-4.5's QK-norm is per head")
    moe_keys = _deepseek_moe_to_hf(config, flags, refuse)
    if problems:
        raise HFConfigError(problems, "cannot export to glm4_moe")
    return {
        "architectures": [FAMILIES["glm4_moe"]], "model_type": "glm4_moe", "dtype": dtype,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": head_dim(config),
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std, "max_position_embeddings": m.seq_length, "attention_dropout": 0.0,
        "attention_bias": m.qkv_bias, "use_qk_norm": m.qk_norm, "router_aux_loss_coef": config.moe.aux_loss_coeff,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor},
        **moe_keys,
    }
