"""What every Hugging Face family module is made of: the :class:`Family` record, the
``config.json`` reader (:class:`Keys`) and the readers and writers several families share,
the model features a family may hold (:data:`FEATURES`) and the shared weight names.

A family module (``families/<model_type>.py``) builds one :class:`Family`; the generic
importer and exporter (``config_map``, ``weights``) look it up by ``model_type`` and never
test a family's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from moe_fold.config import Config, head_dim

from ..sources import Cat, Source, Stack, Take

__all__ = ["FEATURES", "METADATA_KEYS", "HFConfigError", "Keys", "Family", "MoeNames", "mlp_sources", "swiglu",
           "rope_theta", "check_window", "num_experts", "common_sizes", "attention_heads", "yarn_rope",
           "rope_to_hf", "YARN_KEYS", "MLA_NAMES", "mla_sources", "experts_sources", "attention_sources"]

# Keys that do not change what the network computes from token ids.
METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_router_logits", "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
    "initializer_range", "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions",
    "tokenizer_class", "chunk_size_feed_forward",
})

# The model features that not every family holds; the exporter refuses a config that uses
# one its target family lacks (``config_map``'s feature table says how a config uses each).
FEATURES = frozenset({
    "mla",  # multi-head latent attention
    "mla_norm_eps",  # MLA's latent norms with an epsilon of their own
    "qk_norm_scope",  # a QK-norm other than per head (over the projections, or L2)
    "partial_rotary",  # rotary embeddings on part of each head
    "mtp",  # multi-token prediction depths
    "rope_interleave",  # rotary on interleaved pairs
    "topk_norm_min",  # a floor under the top-k renormalisation
    "router_bias", "expert_linear_bias", "expert_activation", "attention_out_bias",
    "yarn",  # YaRN rotary scaling
    "attention_sinks", "sliding_window", "attention_chunk", "rope_layers", "attn_temperature_tuning",
    "score_on_input",  # the routing prob scales the expert's input
    "single_mixer", "mlp_activation", "mamba2",  # Nemotron-H's layers
    "moe_latent",  # Nemotron 3 Super's latent MoE (experts between two latent projections)
    "layer_types", "attn_output_gate", "norm_zero_centred",  # Qwen3-Next's layers (Gated DeltaNet)
    "zero_experts",  # LongCat-Flash's zero-computation experts
    "shortcut_moe", "mla_lora_scale",  # LongCat-Flash's blocks and MLA scaling
    "dsa",  # DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5)
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


class Keys:
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


# refuse(condition, text): record ``text`` as a problem when ``condition`` holds.
Refuse = Callable[[bool, str], None]


@dataclass(frozen=True)
class MoeNames:
    """The tensor names of a family's MoE block in the per-expert form: the block (under
    the layer), the experts' three projections, the expert bias (a Source under the block,
    or None) and the shared experts (gated or not)."""

    block: str = "mlp."
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_bias: Optional[Callable[[str], Source]] = None
    shared: str = "shared_expert."
    shared_gate: bool = True


@dataclass(frozen=True)
class Family:
    """One Hugging Face family.

    - ``model_type``/``architecture``: its ``config.json`` ``model_type`` and causal-LM class;
    - ``features``: the members of :data:`FEATURES` it can hold (the exporter refuses the others);
    - ``from_hf(keys, config)``: reads its ``config.json`` into ``config`` (a fresh or base
      Config whose family-specific fields were reset), recording problems in ``keys``;
    - ``refusals(config, flags, refuse)``: what it cannot hold of a model, with reasons
      (``flags``: the MoE layer flags);
    - ``to_hf(config, flags)``: its ``config.json`` keys for a model it can hold (after
      ``architectures``, ``model_type`` and ``dtype``);
    - ``exports(config)``: whether the model's features call for this family, asked in
      ``export_priority`` order (lowest first; the first yes is the export family);
    - ``mlp_sources(config, hf, ours, is_moe, hf_names)``: the Sources of one layer's MLP
      or MoE block (default: :func:`mlp_sources` of ``moe_names``);
    - ``mixer_sources(config, layer, hf, ours)``: the Sources of layer ``layer``'s mixer
      (attention or a linear-attention type) under ``ours + "attn."`` (default: the
      weights module's standard and MLA attention);
    - ``aliases``: other ``model_type`` values whose ``config.json`` ``from_hf`` reads
      (a text model's own type beside its multimodal wrapper's), with
      ``import_architectures``: the causal-LM classes accepted on import besides
      ``architecture``;
    - ``model_prefix(hf_names)``: where the language model's tensors live in a checkpoint
      with tensors ``hf_names`` (export passes none); default ``model.``;
    - ``layer_sources(config, layer, hf, ours, hf_names)``: the Sources of one whole layer,
      for a family whose layers are not a norm, a mixer, a norm and an MLP (LongCat-Flash's
      two sublayers and shortcut MoE, Nemotron-H's one mixer per layer); None: the weights module's from the two
      hooks above;
    - ``embed_name``, ``final_norm_name``: the embedding's and the final norm's tensors
      under the model prefix."""

    model_type: str
    architecture: str
    features: frozenset
    from_hf: Callable[[Keys, Config], None]
    refusals: Callable[[Config, list, Refuse], None]
    to_hf: Callable[[Config, list], dict]
    exports: Callable[[Config], bool]
    export_priority: int
    moe_names: MoeNames = field(default_factory=MoeNames)
    mlp_sources: Optional[Callable[..., dict]] = None
    mixer_sources: Optional[Callable[..., dict]] = None
    aliases: tuple[str, ...] = ()
    import_architectures: tuple[str, ...] = ()
    model_prefix: Callable[[frozenset], str] = lambda hf_names: "model."
    layer_sources: Optional[Callable[..., dict]] = None
    embed_name: str = "embed_tokens.weight"
    final_norm_name: str = "norm.weight"

    def __post_init__(self):
        unknown = sorted(set(self.features) - FEATURES)
        if unknown:
            raise ValueError(f"family {self.model_type}: features {unknown} are not among {sorted(FEATURES)}")
        if self.mlp_sources is None:
            object.__setattr__(self, "mlp_sources", mlp_sources(self.moe_names))


# --------------------------------------------------------------------------- config readers

def rope_theta(keys: Keys, default: float, partial_rotary: bool = False) -> float:
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


def check_window(keys: Keys, seq_length: int, sliding_layers: bool) -> None:
    window = keys.get("sliding_window", None)
    if sliding_layers and window is not None and window < seq_length:
        keys.problems.append(f"sliding_window={window} is smaller than model.seq_length={seq_length}: this importer "
                             f"does not map {keys.family}'s sliding window to model.sliding_window (a window >= the "
                             f"sequence is plain causal attention)")


def num_experts(keys: Keys, name: str, alias: str) -> Optional[int]:
    """The expert count under its family's name or the other one (transformers 5 writes
    Qwen3-MoE's as ``num_local_experts`` through its attribute map)."""
    value = keys.get(alias, None)
    return keys.get(name) if value is None else keys.get(name, value)


def common_sizes(keys: Keys, m, family: str, *, norm_eps: float = 1e-5, tie: bool = False) -> None:
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


def attention_heads(keys: Keys, m, head_dim: Optional[int] = None) -> None:
    """Grouped-query attention's key/value heads (default: one per query head) and the
    head width (default ``head_dim``, else hidden_size / num_heads)."""
    m.num_kv_heads = keys.get("num_key_value_heads", m.num_heads)
    explicit = keys.get("head_dim", head_dim)
    m.head_dim = int(explicit) if explicit is not None else m.hidden_size // m.num_heads


YARN_KEYS = {"factor": "yarn_factor", "original_max_position_embeddings": "yarn_original_max_position_embeddings",
             "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
             "mscale_all_dim": "yarn_mscale_all_dim"}


def yarn_rope(keys: Keys, m) -> None:
    """``rope_parameters`` (or 4.x ``rope_theta``/``rope_scaling``): default or YaRN
    (DeepSeek-V2/V3 and gpt-oss)."""
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
    for name in YARN_KEYS.values():
        setattr(m, name, None)
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
        for theirs, ours in YARN_KEYS.items():
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


def rope_to_hf(m) -> dict:
    """``rope_parameters``: default, or YaRN with its keys (``truncate`` only when false)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        rope["rope_type"] = "yarn"
        rope.update({theirs: getattr(m, ours) for theirs, ours in YARN_KEYS.items()
                     if getattr(m, ours) is not None})
        if not m.yarn_truncate:
            rope["truncate"] = False
    return rope


# --------------------------------------------------------------------------- weight names

_T = (1, 0)  # Hugging Face [out, in] <-> our expert layout [in, out]

# Our MLA parameter (under ``attn.``) -> its tensor (under ``self_attn.``); q.weight
# without q_lora_rank, the three q_* low-rank ones with it.
MLA_NAMES = {"q.weight": "q_proj.weight", "q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
             "q_up.weight": "q_b_proj.weight", "kv_down.weight": "kv_a_proj_with_mqa.weight",
             "kv_norm.weight": "kv_a_layernorm.weight", "kv_up.weight": "kv_b_proj.weight",
             "proj.weight": "o_proj.weight"}


def mla_sources(config: Config, attn: str, ours: str) -> dict[str, Source]:
    """An MLA layer's Sources: ours under ``ours`` (ending ``attn.``), theirs under ``attn``
    (ending ``self_attn.``)."""
    query = ("q.weight",) if config.model.q_lora_rank is None else ("q_down.weight", "q_norm.weight", "q_up.weight")
    return {f"{ours}{name}": Take(f"{attn}{MLA_NAMES[name]}")
            for name in query + ("kv_down.weight", "kv_norm.weight", "kv_up.weight", "proj.weight")}


def swiglu(prefix: str, gate: str, up: str, down: str, ffn: int) -> tuple[Source, Source]:
    """fc1 [gate|up, H] and fc2 of a dense SwiGLU MLP stored as three linears."""
    fc1 = Cat(0, (Take(f"{prefix}{gate}.weight"), Take(f"{prefix}{up}.weight")), (ffn, ffn))
    return fc1, Take(f"{prefix}{down}.weight")


def experts_sources(prefix: str, names: tuple[str, str, str], num_experts: int, ffn: int,
             fused: bool) -> tuple[Source, Source]:
    """fc1 ``[E, H, gate|up]`` and fc2 ``[E, F, H]`` of the routed experts."""
    if fused:
        return Take(f"{prefix}experts.gate_up_proj", (0, 2, 1)), Take(f"{prefix}experts.down_proj", (0, 2, 1))
    gate, up, down = names
    fc1 = Stack(tuple(Cat(1, (Take(f"{prefix}experts.{e}.{gate}.weight", _T),
                              Take(f"{prefix}experts.{e}.{up}.weight", _T)), (ffn, ffn))
                      for e in range(num_experts)))
    fc2 = Stack(tuple(Take(f"{prefix}experts.{e}.{down}.weight", _T) for e in range(num_experts)))
    return fc1, fc2


def mlp_sources(names: MoeNames) -> Callable[..., dict]:
    """The Sources of one layer's dense MLP (``mlp.{gate,up,down}_proj``) or MoE block named
    by ``names``: the router's ``gate.weight``, the experts (per expert, or fused as
    transformers 5 holds them in memory: ``mlp.experts.gate_up_proj [E, 2F, H]``,
    ``mlp.experts.down_proj [E, H, F]``), the expert bias and the shared experts."""

    def sources(config: Config, hf: str, ours: str, is_moe: bool, hf_names: frozenset) -> dict[str, Source]:
        m, moe = config.model, config.moe
        out: dict[str, Source] = {}
        if not is_moe:
            fc1, fc2 = swiglu(f"{hf}mlp.", "gate_proj", "up_proj", "down_proj", m.ffn_hidden_size)
            out[f"{ours}mlp.fc1.weight"], out[f"{ours}mlp.fc2.weight"] = fc1, fc2
            return out
        fused = f"{hf}mlp.experts.gate_up_proj" in hf_names
        block = f"{hf}mlp." if fused else f"{hf}{names.block}"
        out[f"{ours}mlp.router.weight"] = Take(f"{block}gate.weight")
        out[f"{ours}mlp.experts.fc1"], out[f"{ours}mlp.experts.fc2"] = experts_sources(
            block, names.experts, moe.num_experts, moe.ffn_hidden_size, fused)
        if names.expert_bias is not None:
            out[f"{ours}mlp.router.expert_bias"] = names.expert_bias(block)
        # Ungated shared experts are named whatever their width; a gated one only when it exists.
        if not names.shared_gate or moe.shared_expert_ffn_hidden_size > 0:
            fc1, fc2 = swiglu(f"{block}{names.shared}", "gate_proj", "up_proj", "down_proj",
                              moe.shared_expert_ffn_hidden_size)
            out[f"{ours}mlp.shared_expert.fc1.weight"], out[f"{ours}mlp.shared_expert.fc2.weight"] = fc1, fc2
            if names.shared_gate:
                out[f"{ours}mlp.shared_expert_gate"] = Take(f"{hf}mlp.shared_expert_gate.weight")
        return out

    return sources


def attention_sources(config: Config, layer: int, hf: str, ours: str) -> dict[str, Source]:
    """The sources of a standard or MLA attention layer's parameters (ours under
    ``ours + "attn."``, theirs under ``hf + "self_attn."``)."""
    m = config.model
    hd = head_dim(config)
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    out: dict[str, Source] = {}
    attn = f"{hf}self_attn."
    if m.attention == "mla":
        out.update(mla_sources(config, attn, f"{ours}attn."))
    else:
        out[f"{ours}attn.qkv.weight"] = Cat(0, tuple(Take(f"{attn}{p}_proj.weight") for p in "qkv"), (q, kv, kv))
        out[f"{ours}attn.proj.weight"] = Take(f"{attn}o_proj.weight")
    if m.attention_out_bias:
        out[f"{ours}attn.proj.bias"] = Take(f"{attn}o_proj.bias")
    if m.attention_sinks:
        out[f"{ours}attn.sinks"] = Take(f"{attn}sinks")  # gpt-oss: one logit per query head
    if m.qkv_bias:
        out[f"{ours}attn.qkv.bias"] = Cat(0, tuple(Take(f"{attn}{p}_proj.bias") for p in "qkv"), (q, kv, kv))
    if m.qk_norm and m.qk_norm_scope != "l2":  # Llama-4's L2 norm has no weight
        out[f"{ours}attn.q_norm.weight"] = Take(f"{attn}q_norm.weight")
        out[f"{ours}attn.k_norm.weight"] = Take(f"{attn}k_norm.weight")
    return out
