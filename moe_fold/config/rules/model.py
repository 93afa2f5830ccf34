"""Rules of the model: sizes, heads and widths over tp and cp, MTP, attention features,
MLA and the rotary scaling."""

from __future__ import annotations

from typing import Optional

from ..derived import CHANNEL_MIXERS, MLA_SIZES, conv_shape_problem, conv_shapes, head_dim
from ..schema import Config, ModelConfig, _fmt
from .common import _at_least, _divisible, _positive, rule


def _check_model(config: Config, any_dense: bool, out: list[str]) -> None:
    m, p = config.model, config.parallel
    sizes_ok = True
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "seq_length"):
        sizes_ok &= _at_least(out, f"model.{name}", getattr(m, name), 1)
    if m.head_dim is not None:
        _at_least(out, "model.head_dim", m.head_dim, 1)
    if any_dense:
        _at_least(out, "model.ffn_hidden_size", m.ffn_hidden_size, 1)
    for name in ("rope_theta", "norm_eps", "init_std"):
        _positive(out, f"model.{name}", getattr(m, name))
    _check_mtp(config, out)
    _check_attention_features(config, out)
    if not 0 < m.partial_rotary_factor <= 1:
        out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} must be in (0, 1]")
    elif m.partial_rotary_factor != 1 and m.attention == "mla":
        out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} must be 1 when model.attention=mla "
                   f"(MLA's rotary part is model.qk_rope_head_dim)")
    elif (m.partial_rotary_factor != 1 and m.attention != "mla" and m.num_heads >= 1
          and (m.head_dim is not None or m.hidden_size % m.num_heads == 0)):
        width = head_dim(config) * m.partial_rotary_factor
        if width != int(width) or int(width) % 2 or int(width) < 2:
            out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} of head_dim={head_dim(config)} "
                       f"gives {width:g} rotary dims: it must be a positive even integer")
    if not sizes_ok:
        return
    if m.num_heads % m.num_kv_heads:
        out.append(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
    if m.attention != "mla" and m.head_dim is None and m.hidden_size % m.num_heads:
        out.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads} "
                   f"(required when model.head_dim is null)")
    elif m.attention != "mla":
        out.extend(rotary_pairs(head_dim(config), "model.head_dim" if m.head_dim is not None
                                else "model.hidden_size/num_heads"))
    _check_attention(m, out)
    _check_layer_types(m, out)
    _check_dsa(config, out)
    if p.tp < 1 or p.cp < 1:
        return
    if m.layer_types is not None and set(m.layer_types) & set(RECURRENT_TYPES):
        out.extend(linear_heads_over_tp(m.linear_num_key_heads, m.linear_num_value_heads, p.tp))
        # Under cp a segment's conv window reads the tail of the one segment before it.
        if p.cp > 1 and m.seq_length // (2 * p.cp) < m.linear_conv_kernel - 1:
            out.append(f"model.seq_length={m.seq_length} over 2*parallel.cp={2 * p.cp} segments gives "
                       f"{m.seq_length // (2 * p.cp)} tokens each; the short conv window of Gated DeltaNet and "
                       f"KDA needs at least model.linear_conv_kernel-1={m.linear_conv_kernel - 1}")
    if m.layer_types is not None and "mamba2" in m.layer_types:
        out.extend(mamba_groups_over_tp(m.mamba_num_groups, p.tp))
        if p.cp > 1 and m.seq_length // (2 * p.cp) < m.mamba_conv_kernel - 1:
            out.append(f"model.seq_length={m.seq_length} over 2*parallel.cp={2 * p.cp} segments gives "
                       f"{m.seq_length // (2 * p.cp)} tokens each; Mamba2's conv window needs at least "
                       f"model.mamba_conv_kernel-1={m.mamba_conv_kernel - 1}")
    if m.conv_backend == "causal_conv1d":
        for kind, (width, channels) in conv_shapes(m, p.tp).items():
            why = conv_shape_problem(width, channels)
            if why is not None:
                out.append(f"model.conv_backend=causal_conv1d cannot take the short conv of the {kind} layers: "
                           f"{why}; set model.conv_backend=torch (or auto)")
    out.extend(heads_over_tp(m.num_heads, m.num_kv_heads, p.tp))
    out.extend(vocab_over_tp(m.vocab_size, p.tp))
    if any_dense:
        out.extend(dense_width_over_tp(m.ffn_hidden_size, p.tp))
    out.extend(sequence_over_tp(m.seq_length, p.tp, p.cp, p.sequence_parallel))
    out.extend(sequence_over_cp(m.seq_length, p.cp))
    if p.cp > 1:
        if p.cp_kind == "a2a":
            # Kv heads need only divide by tp: a2a repeats each tp rank's kv heads up to a
            # multiple of cp (context_parallel.a2a_kv_repeats), which divides the query heads.
            why = " (parallel.cp_kind=a2a splits each tp rank's heads over cp)"
            _divisible(out, "model.num_heads", m.num_heads, "parallel.tp*cp", p.tp * p.cp, why)


@rule
def heads_over_tp(num_heads: int, num_kv_heads: int, tp: int) -> list[str]:
    """Each tp rank holds num_heads/tp query and num_kv_heads/tp key/value heads."""
    out: list[str] = []
    _divisible(out, "model.num_heads", num_heads, "parallel.tp", tp)
    _divisible(out, "model.num_kv_heads", num_kv_heads, "parallel.tp", tp)
    return out


LAYER_TYPES = ("attention", "gated_deltanet", "kda", "mamba2") + CHANNEL_MIXERS
# The layer types with a short conv and a recurrent state (the linear_* sizes).
RECURRENT_TYPES = ("gated_deltanet", "kda")


def _check_layer_types(m: ModelConfig, out: list[str]) -> None:
    """Each layer's mixer, Gated DeltaNet's and KDA's sizes, the output gate and the zero-centred norm."""
    if m.layer_types is not None:
        if len(m.layer_types) != m.num_layers:
            out.append(f"model.layer_types has {len(m.layer_types)} entries; it must have one per layer "
                       f"(model.num_layers={m.num_layers})")
        for i, kind in enumerate(m.layer_types):
            if kind not in LAYER_TYPES:
                out.append(f"model.layer_types[{i}]={kind!r} must be one of {', '.join(LAYER_TYPES)}")
        for i, kind in enumerate(m.layer_types):
            if kind in CHANNEL_MIXERS and m.block != "single_mixer":
                out.append(f"model.layer_types[{i}]={kind!r} is a layer with a channel mixer alone: it needs "
                           f"model.block=single_mixer")
        if set(m.layer_types) & set(RECURRENT_TYPES):
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel", "linear_chunk_size"):
                _at_least(out, f"model.{name}", getattr(m, name), 1)
            if m.linear_num_key_heads >= 1 and m.linear_num_value_heads % m.linear_num_key_heads:
                out.append(f"model.linear_num_value_heads={m.linear_num_value_heads} must be a multiple of "
                           f"model.linear_num_key_heads={m.linear_num_key_heads} (a key head serves whole value heads)")
        if "kda" in m.layer_types:
            for field, of_key in (("linear_num_value_heads", "linear_num_key_heads"),
                                  ("linear_value_head_dim", "linear_key_head_dim")):
                if getattr(m, field) != getattr(m, of_key):
                    out.append(f"model.{field}={getattr(m, field)} must equal model.{of_key}={getattr(m, of_key)} "
                               f"with kda layers (KDA's q, k and v heads have one count and one width)")
        if "mamba2" in m.layer_types:
            for name in ("mamba_num_heads", "mamba_head_dim", "mamba_state_size", "mamba_num_groups",
                         "mamba_conv_kernel", "mamba_chunk_size"):
                _at_least(out, f"model.{name}", getattr(m, name), 1)
            if m.mamba_num_groups >= 1 and m.mamba_num_heads % m.mamba_num_groups:
                out.append(f"model.mamba_num_heads={m.mamba_num_heads} must be a multiple of "
                           f"model.mamba_num_groups={m.mamba_num_groups} (a group's B and C serve whole heads)")
            if not 0 < m.mamba_dt_min <= m.mamba_dt_max:
                out.append(f"model.mamba_dt_min={_fmt(m.mamba_dt_min)} and model.mamba_dt_max={_fmt(m.mamba_dt_max)} "
                           f"must satisfy 0 < mamba_dt_min <= mamba_dt_max (the steps dt_bias starts from)")
    if m.block == "single_mixer":
        if m.layer_types is None:
            out.append("model.block=single_mixer needs model.layer_types (each layer's one mixer)")
        if m.mtp_num_layers:
            out.append(f"model.mtp_num_layers={m.mtp_num_layers} with model.block=single_mixer: the MTP "
                       f"depths' blocks are attention + MLP blocks; set model.mtp_num_layers=0")
    if m.attn_output_gate and m.attention == "mla":
        out.append("model.attn_output_gate=true needs model.attention=mha (the gate is projected with the query)")
    if m.norm_zero_centred and m.attention == "mla":
        out.append("model.norm_zero_centred=true needs model.attention=mha (MLA's latent norms are not zero-centred)")


BLOCKS = ("standard", "shortcut_moe", "single_mixer")


@rule
def shortcut_moe_block(block: str, moe_flags: list, layer_types: Optional[list], mtp_num_layers: int) -> list[str]:
    """model.block=shortcut_moe (LongCat-Flash): every block holds its MoE, both sublayers'
    mixers are attention, and no MTP depth (a standard block) follows."""
    if block != "shortcut_moe":
        return []
    out: list[str] = []
    if not all(moe_flags):
        out.append(f"model.block=shortcut_moe needs an MoE in every block, but the MoE layers are "
                   f"{[int(f) for f in moe_flags]} (set moe.moe_layer_freq=1 and moe.first_k_dense=0)")
    if layer_types is not None and set(layer_types) != {"attention"}:
        out.append(f"model.layer_types={_fmt(layer_types)} cannot run with model.block=shortcut_moe: its two "
                   f"sublayers are attention")
    if mtp_num_layers > 0:
        out.append(f"model.mtp_num_layers={mtp_num_layers} cannot run with model.block=shortcut_moe: an MTP depth "
                   f"is a standard block")
    return out


def _check_block(config: Config, moe_flags: Optional[list], out: list[str]) -> None:
    """The block kind and MLA's LoRA scaling and latent epsilon."""
    m = config.model
    if moe_flags is not None:
        out.extend(shortcut_moe_block(m.block, moe_flags, m.layer_types, m.mtp_num_layers))
    if m.mla_lora_scale and (m.attention != "mla" or m.q_lora_rank is None):
        out.append(f"model.mla_lora_scale=true needs model.attention=mla with a model.q_lora_rank (it scales the "
                   f"query's and the key/value's low-rank latents), not attention={m.attention}, "
                   f"q_lora_rank={_fmt(m.q_lora_rank)}")
    if m.mla_norm_eps is not None:
        if m.attention != "mla":
            out.append(f"model.mla_norm_eps={_fmt(m.mla_norm_eps)} is set but model.attention={m.attention} "
                       f"(it is the epsilon of MLA's latent norms)")
        _positive(out, "model.mla_norm_eps", m.mla_norm_eps)


@rule
def linear_heads_over_tp(num_key_heads: int, num_value_heads: int, tp: int) -> list[str]:
    """Each tp rank holds linear_num_key_heads/tp Gated DeltaNet key heads with their value heads."""
    out: list[str] = []
    _divisible(out, "model.linear_num_key_heads", num_key_heads, "parallel.tp", tp)
    _divisible(out, "model.linear_num_value_heads", num_value_heads, "parallel.tp", tp)
    return out


@rule
def mamba_groups_over_tp(num_groups: int, tp: int) -> list[str]:
    """Each tp rank holds mamba_num_groups/tp Mamba2 groups with their heads."""
    out: list[str] = []
    _divisible(out, "model.mamba_num_groups", num_groups, "parallel.tp", tp)
    return out


@rule
def rotary_pairs(width: int, dotted: str = "model.head_dim") -> list[str]:
    """Rotary embeddings rotate pairs of dimensions: the rotated width is even."""
    if width % 2:
        return [f"{dotted}={width} must be even (rotary embeddings rotate pairs of dimensions)"]
    return []


@rule
def vocab_over_tp(vocab_size: int, tp: int) -> list[str]:
    """Each tp rank holds vocab_size/tp rows of the embedding and the output layer."""
    out: list[str] = []
    _divisible(out, "model.vocab_size", vocab_size, "parallel.tp", tp)
    return out


@rule
def dense_width_over_tp(ffn_hidden_size: int, tp: int) -> list[str]:
    """Each tp rank holds ffn_hidden_size/tp columns of a dense MLP."""
    out: list[str] = []
    _divisible(out, "model.ffn_hidden_size", ffn_hidden_size, "parallel.tp", tp)
    return out


@rule
def sequence_over_tp(seq_length: int, tp: int, cp: int, sequence_parallel: bool) -> list[str]:
    """Sequence parallelism splits each cp shard of the sequence over tp."""
    out: list[str] = []
    if sequence_parallel and tp > 1:
        _divisible(out, "model.seq_length", seq_length, "parallel.tp*cp", tp * cp,
                   " (parallel.sequence_parallel=true splits each cp shard of the sequence over tp)")
    return out


@rule
def sequence_over_cp(seq_length: int, cp: int) -> list[str]:
    """Context parallelism cuts the sequence into 2*cp chunks (the zigzag layout)."""
    out: list[str] = []
    if cp > 1:
        _divisible(out, "model.seq_length", seq_length, "2*parallel.cp", 2 * cp,
                   " (context parallel splits the sequence into 2*cp chunks)")
    return out


def _check_mtp(config: Config, out: list[str]) -> None:
    m, p = config.model, config.parallel
    if not _at_least(out, "model.mtp_num_layers", m.mtp_num_layers, 0):
        return
    _at_least(out, "model.mtp_loss_weight", m.mtp_loss_weight, 0)
    if m.mtp_num_layers == 0:
        return
    if m.seq_length >= 1 and m.mtp_num_layers >= m.seq_length:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers} must be < model.seq_length={m.seq_length} "
                   f"(depth k predicts token t+1+k inside the sequence)")
    if p.dynamic_cp:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers} is not supported with parallel.dynamic_cp=true "
                   f"(the MTP targets are shifted along the layout's cp shards)")


def _check_attention_features(config: Config, out: list[str]) -> None:
    """Sinks, sliding window, chunked attention, NoPE layers, temperature tuning."""
    m = config.model
    window_ok = _at_least(out, "model.sliding_window", m.sliding_window, 0)
    chunk_ok = _at_least(out, "model.attention_chunk", m.attention_chunk, 0)
    if window_ok and chunk_ok and m.sliding_window and m.attention_chunk:
        out.append(f"model.sliding_window={m.sliding_window} and model.attention_chunk={m.attention_chunk}: "
                   f"set at most one (a local layer has one kind of mask)")
    for name in ("local_attention_layers", "rope_layers"):
        flags = getattr(m, name)
        if flags is not None and m.num_layers >= 1 and (
                len(flags) != m.num_layers or any(f not in (0, 1) for f in flags)):
            out.append(f"model.{name}={_fmt(flags)} must be {m.num_layers} flags of 0 or 1 "
                       f"(one per layer of model.num_layers={m.num_layers})")
    if m.local_attention_layers is not None and not (m.sliding_window or m.attention_chunk):
        out.append(f"model.local_attention_layers={_fmt(m.local_attention_layers)} is set but "
                   f"model.sliding_window and model.attention_chunk are 0 (no local attention)")
    _positive(out, "model.attn_temperature_scale", m.attn_temperature_scale)
    _at_least(out, "model.attn_temperature_floor", m.attn_temperature_floor, 1)
    if m.attn_temperature_tuning and m.mtp_num_layers > 0:
        out.append(f"model.attn_temperature_tuning=true is not supported with model.mtp_num_layers="
                   f"{m.mtp_num_layers} (the MTP depths' attention gets no token positions)")
    if m.qk_norm and m.qk_norm_scope == "l2" and m.rope_layers is not None and not any(m.rope_layers):
        out.append("model.qk_norm_scope=l2 normalises rotary layers only, but model.rope_layers has none")
    if m.attention == "mla":
        for name, off in (("attention_sinks", False), ("sliding_window", 0), ("attention_chunk", 0),
                          ("attn_temperature_tuning", False)):
            if getattr(m, name) != off:
                out.append(f"model.{name}={_fmt(getattr(m, name))} requires model.attention=mha "
                           f"(MLA's attention does not take it)")


def _check_dsa(config: Config, out: list[str]) -> None:
    """DeepSeek Sparse Attention: an indexer on MLA with a query latent, its sizes and layers."""
    m = config.model
    if m.mla_norm_eps is not None:
        _positive(out, "model.mla_norm_eps", m.mla_norm_eps)
    if not m.dsa:
        if m.indexer_types is not None:
            out.append(f"model.indexer_types={m.indexer_types} is set but model.dsa=false")
        return
    if m.attention != "mla" or m.q_lora_rank is None:
        out.append(f"model.dsa=true needs model.attention=mla with model.q_lora_rank set (the indexer's queries "
                   f"read MLA's query latent); got model.attention={m.attention}, model.q_lora_rank={m.q_lora_rank}")
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        _at_least(out, f"model.{name}", getattr(m, name), 1)
    if m.qk_rope_head_dim is not None and m.index_head_dim < m.qk_rope_head_dim:
        out.append(f"model.index_head_dim={m.index_head_dim} must be >= model.qk_rope_head_dim="
                   f"{m.qk_rope_head_dim} (the indexer's first qk_rope_head_dim dims take rotary)")
    if m.dsa_indexer_loss_weight < 0:
        out.append(f"model.dsa_indexer_loss_weight={_fmt(m.dsa_indexer_loss_weight)} must be >= 0")
    if m.layer_types is not None and any(t != "attention" for t in m.layer_types):
        out.append(f"model.dsa=true needs attention on every layer; model.layer_types={m.layer_types}")
    if m.block != "standard":
        out.append(f"model.block={m.block} is not supported with model.dsa=true: a shortcut-MoE block holds two "
                   f"attention sublayers under one layer index, while model.indexer_types and the selections a "
                   f"shared layer reuses are per layer (no released model has both: LongCat-Flash's MLA has no "
                   f"indexer)")
    types = m.indexer_types
    if types is None:
        return
    if len(types) != m.num_layers:
        out.append(f"model.indexer_types has {len(types)} entries; it must have one per layer "
                   f"(model.num_layers={m.num_layers})")
        return
    for i, kind in enumerate(types):
        if kind not in ("full", "shared"):
            out.append(f"model.indexer_types[{i}]={kind!r} must be full or shared")
    if types and types[0] != "full":
        out.append(f"model.indexer_types[0]={types[0]!r} must be full (a shared layer reuses the selection of a "
                   f"full layer before it)")
    if "shared" in types and m.dsa_stage != "sparse":
        out.append(f"model.dsa_stage={m.dsa_stage} with shared layers in model.indexer_types: the dense warm-up "
                   f"makes no selection for a shared layer to reuse; use dsa_stage=sparse")


def _check_attention(m: ModelConfig, out: list[str]) -> None:
    """The attention kind, MLA's sizes and the rotary scaling."""
    if m.attention == "mla":
        for name in MLA_SIZES:
            value = getattr(m, name)
            if value is None:
                out.append(f"model.{name}=null must be set when model.attention=mla")
            else:
                _at_least(out, f"model.{name}", value, 1)
        if m.q_lora_rank is not None:
            _at_least(out, "model.q_lora_rank", m.q_lora_rank, 1)
        if m.qk_rope_head_dim is not None and m.qk_rope_head_dim % 2:
            out.append(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")
        if m.num_kv_heads != m.num_heads:
            out.append(f"model.num_kv_heads={m.num_kv_heads} must equal model.num_heads={m.num_heads} when "
                       f"model.attention=mla (every head has its own key and value)")
        if m.qk_norm or m.qkv_bias:
            out.append("model.qk_norm and model.qkv_bias must be false when model.attention=mla")
        if m.attention_out_bias:
            out.append("model.attention_out_bias=true requires model.attention=mha (MLA's output projection has "
                       "no bias)")
        if m.head_dim is not None:
            out.append(f"model.head_dim={m.head_dim} must be null when model.attention=mla (MLA's head widths are "
                       f"model.qk_nope_head_dim, model.qk_rope_head_dim and model.v_head_dim)")
    elif m.attention == "mha":
        for name in ("q_lora_rank",) + MLA_SIZES:
            if getattr(m, name) is not None:
                out.append(f"model.{name}={getattr(m, name)} is an MLA size: set model.attention=mla or leave "
                           f"it null")
    if m.rope_scaling is None:
        for name in ("yarn_factor", "yarn_original_max_position_embeddings", "yarn_mscale", "yarn_mscale_all_dim"):
            if getattr(m, name) is not None:
                out.append(f"model.{name}={_fmt(getattr(m, name))} is set but model.rope_scaling is null")
        return
    if m.rope_scaling != "yarn":
        return
    if m.yarn_factor is None:
        out.append("model.yarn_factor=null must be set when model.rope_scaling=yarn")
    elif not m.yarn_factor >= 1:
        out.append(f"model.yarn_factor={_fmt(m.yarn_factor)} must be >= 1")
    if m.yarn_original_max_position_embeddings is None:
        out.append("model.yarn_original_max_position_embeddings=null must be set when model.rope_scaling=yarn")
    else:
        _at_least(out, "model.yarn_original_max_position_embeddings", m.yarn_original_max_position_embeddings, 1)
    _positive(out, "model.yarn_beta_fast", m.yarn_beta_fast)
    _positive(out, "model.yarn_beta_slow", m.yarn_beta_slow)
    if not m.yarn_beta_fast >= m.yarn_beta_slow:
        out.append(f"model.yarn_beta_fast={_fmt(m.yarn_beta_fast)} must be >= "
                   f"model.yarn_beta_slow={_fmt(m.yarn_beta_slow)}")
    for name in ("yarn_mscale", "yarn_mscale_all_dim"):
        if getattr(m, name) is not None:
            _at_least(out, f"model.{name}", getattr(m, name), 0)
