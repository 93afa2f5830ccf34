"""Derived sizes and layer patterns: one definition each, used by every module
(``dp_size``, ``edp_size``, ``etp_size``, ``vpp_size``, ``pipeline_schedule``,
``moe_layer_flags``, ``moe_layer_indices``, ``pp_layer_counts``, ...)."""

from __future__ import annotations

from typing import Optional

from .schema import Config, ConfigError, ModelConfig, _fmt


def etp_size(config: Config) -> int:
    p = config.parallel
    return p.tp if p.etp is None else p.etp


def vpp_size(config: Config) -> int:
    return 1 if config.parallel.vpp is None else config.parallel.vpp


def pipeline_schedule(config: Config) -> str:
    """``parallel.pp_schedule`` resolved: ``auto`` is interleaved with vpp > 1 chunks, else 1f1b."""
    schedule = config.parallel.pp_schedule
    if schedule == "auto":
        return "interleaved" if vpp_size(config) > 1 else "1f1b"
    return schedule


def dp_size(config: Config, world_size: int) -> int:
    """Data-parallel size of the attention layout: world / (tp*cp*pp)."""
    p = config.parallel
    return _exact_div(world_size, p.tp * p.cp * p.pp, "world_size", "parallel.tp*cp*pp")


def edp_size(config: Config, world_size: int) -> int:
    """Expert data-parallel size of the expert layout: world / (etp*ep*pp)."""
    p = config.parallel
    return _exact_div(world_size, etp_size(config) * p.ep * p.pp, "world_size", "parallel.etp*ep*pp")


def head_dim(config: Config) -> int:
    """Per-head width of standard attention (MLA's widths are its own fields)."""
    m = config.model
    return m.hidden_size // m.num_heads if m.head_dim is None else m.head_dim


def rotary_dim(config: Config) -> int:
    """Width of the rotary part of a query/key head: its first ``partial_rotary_factor``
    (default: the whole head) under mha, ``qk_rope_head_dim`` under mla."""
    m = config.model
    return m.qk_rope_head_dim if m.attention == "mla" else int(head_dim(config) * m.partial_rotary_factor)


def mla_weight_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Global ``[out, in]`` shapes of an MLA layer's linears, by our parameter name under
    ``attn.`` (norms aside): what the model builds and the planner and dynamic-cp cost
    model count."""
    heads, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes = {}
    if m.q_lora_rank is None:
        shapes["q"] = (heads * qk, m.hidden_size)
    else:
        shapes["q_down"] = (m.q_lora_rank, m.hidden_size)
        shapes["q_up"] = (heads * qk, m.q_lora_rank)
    shapes["kv_down"] = (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size)
    shapes["kv_up"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes["proj"] = (m.hidden_size, heads * m.v_head_dim)
    return shapes


def group_ranked_scores(group_score: str, topk: int, group_topk: int) -> int:
    """How many of a group's best scores add up to its rank in group-limited routing
    (``moe.group_score``): topk/group_topk for topk_sum, 2 for top2_sum, 1 for max. Two
    rules with the same count route identically."""
    return {"topk_sum": topk // group_topk, "top2_sum": 2, "max": 1}[group_score]


MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def moe_layer_flags(config: Config) -> list[bool]:
    """One flag per layer, True where the layer's MLP is an MoE layer: every
    ``moe_layer_freq``-th layer from layer 0 (or the given 0/1 list), then the first
    ``first_k_dense`` layers forced dense; with ``model.block: single_mixer``, the layers
    whose ``model.layer_types`` entry is ``moe``."""
    m, moe = config.model, config.moe
    if m.block == "single_mixer" and m.layer_types is not None:
        return [kind == "moe" for kind in m.layer_types]
    freq = moe.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(f not in (0, 1) for f in freq):
            raise ConfigError(f"moe.moe_layer_freq={_fmt(freq)} must be {m.num_layers} flags of 0 or 1 "
                              f"(one per layer of model.num_layers={m.num_layers})")
        flags = [f == 1 for f in freq]
    else:
        if freq < 0:
            raise ConfigError(f"moe.moe_layer_freq={freq} must be >= 0")
        flags = [freq > 0 and i % freq == 0 for i in range(m.num_layers)]
    return [flag and i >= moe.first_k_dense for i, flag in enumerate(flags)]


def _layer_list(m: ModelConfig, name: str) -> list[bool]:
    """``model.<name>`` (null: every layer; else one 0/1 per layer) as one flag per layer."""
    flags = getattr(m, name)
    if flags is None:
        return [True] * m.num_layers
    if len(flags) != m.num_layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"model.{name}={_fmt(flags)} must be {m.num_layers} flags of 0 or 1 "
                          f"(one per layer of model.num_layers={m.num_layers})")
    return [f == 1 for f in flags]


def layer_attention(m: ModelConfig, layer: int) -> tuple[int, int, bool]:
    """``(sliding window, attention chunk, rotary?)`` of layer ``layer`` (0: none); MTP
    depths (``layer >= num_layers``) are of the last layer's kind, as their MLP."""
    layer = min(layer, m.num_layers - 1)
    local = _layer_list(m, "local_attention_layers")[layer]
    return (m.sliding_window if local else 0, m.attention_chunk if local else 0,
            _layer_list(m, "rope_layers")[layer])


# The layer types of model.block=single_mixer that are a channel mixer alone (no token mixer).
CHANNEL_MIXERS = ("mlp", "moe")


def layer_mixer(m: ModelConfig, layer: int) -> str:
    """The mixer of layer ``layer``: ``model.layer_types[layer]``, attention when unset;
    MTP depths (``layer >= num_layers``) use attention, as Qwen3-Next's do."""
    if m.layer_types is None or layer >= m.num_layers:
        return "attention"
    return m.layer_types[layer]


def conv_shapes(m: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """The short conv of each recurrent layer type in ``m.layer_types``: ``(width, channels
    per tp rank)`` (q|k|v of Gated DeltaNet and KDA, x|B|C of Mamba2)."""
    kinds = set(m.layer_types or ())
    shapes = {}
    linear = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    for kind in ("gated_deltanet", "kda"):
        if kind in kinds:
            shapes[kind] = (m.linear_conv_kernel, linear // tp)
    if "mamba2" in kinds:
        mamba = m.mamba_num_heads * m.mamba_head_dim + 2 * m.mamba_num_groups * m.mamba_state_size
        shapes["mamba2"] = (m.mamba_conv_kernel, mamba // tp)
    return shapes


def conv_shape_problem(width: int, channels: int) -> Optional[str]:
    """Why causal-conv1d's kernels (``model.conv_backend=causal_conv1d``) cannot take a conv of
    ``width`` taps over ``channels`` channels (None: they can)."""
    if not 2 <= width <= 4:
        return f"causal-conv1d takes kernel widths 2 to 4, got {width}"
    if channels % 8:
        return f"causal-conv1d takes channels in multiples of 8 (its channel-last layout), got {channels}"
    return None


def moe_layer_indices(config: Config) -> list[int]:
    """The MoE layers' indices, then the MTP depths' blocks as ``num_layers + k`` when they
    are MoE (they are of the last layer's kind): the rows of routing metrics and heatmaps."""
    flags = moe_layer_flags(config)
    mtp = config.model.mtp_num_layers if flags and flags[-1] else 0
    return [i for i, flag in enumerate(flags) if flag] + [len(flags) + k for k in range(mtp)]


def pp_layer_counts(config: Config) -> list[int]:
    """Layers in each of the pp*vpp model chunks, in chunk order."""
    p = config.parallel
    if p.pp_layers is not None:
        return list(p.pp_layers)
    chunks = p.pp * vpp_size(config)
    return [_exact_div(config.model.num_layers, chunks, "model.num_layers", "parallel.pp*vpp")] * chunks


def data_paths(config: Config) -> list[str]:
    """``data.path`` as a list (empty when None: the demo corpus)."""
    path = config.data.path
    return [] if path is None else [path] if isinstance(path, str) else list(path)


# The sizes a parallel.elastic_layouts entry may set.
ELASTIC_SIZES = ("tp", "cp", "pp", "ep", "etp")


def parse_elastic_layout(text: str) -> dict[str, int]:
    """One ``parallel.elastic_layouts`` entry, ``"ep=2"`` or ``"tp=1,ep=4"``, as ``{name: size}``;
    raises ValueError saying what is wrong."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or name not in ELASTIC_SIZES or name in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{part.strip()!r} must be name=size with a name of {', '.join(ELASTIC_SIZES)} "
                             f"(each once) and a size >= 1")
        sizes[name] = int(value)
    return sizes


def _exact_div(a: int, b: int, a_name: str, b_name: str) -> int:
    if b < 1 or a % b:
        raise ConfigError(f"{a_name}={a} is not divisible by {b_name}={b}")
    return a // b
