"""Load a Hugging Face model folder into this rank's shard of our model, any layout.

Every rank opens the safetensors files itself and reads, for each piece of each local
parameter (:func:`moe_fold.parallel.sharding.shard_info`: a box of the global tensor), only the
slices that box covers: a tp rank reads its heads' rows of q, k and v, an ep rank its
experts, an etp rank its columns of them. No rank ever holds a global tensor it does not
own, and no communication happens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from moe_fold.config import Config, group_ranked_scores, head_dim, moe_layer_flags, validate
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.sharding import box, buffer_info, shard_info

from .config_map import HFConfigError, config_from_hf, hf_family
from .weights import HFWeightError, SafetensorsFolder, ignorable_hf_names, weight_sources

__all__ = ["read_hf_config", "hf_config", "hf_tokenizer", "load_hf_into", "read_sources_into", "from_hf"]

PathLike = Union[str, os.PathLike]


def read_hf_config(path: PathLike) -> dict:
    """The parsed ``config.json`` of the Hugging Face folder ``path``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: {file} does not exist")
    return json.loads(file.read_text())


def hf_config(path: PathLike, base: Optional[Config] = None) -> Config:
    """``base`` (default ``Config()``) with the architecture of the Hugging Face model at
    ``path`` (see :func:`~moe_fold.models.hf.config_map.config_from_hf`); and, when the
    folder has a ``tokenizer.json`` and ``base`` keeps the byte tokenizer, the folder
    as ``data.tokenizer`` so the data is tokenized with the model's own vocabulary."""
    config = _checkpoint_config(path, read_hf_config(path), base)
    if config.data.tokenizer == "byte" and hf_tokenizer(path) is not None:
        config.data.tokenizer = str(path)
    return config


def _checkpoint_config(path: PathLike, hf: dict, base: Optional[Config]) -> Config:
    """:func:`config_from_hf`, with ``model.mtp_num_layers`` the MTP depths whose tensors
    the checkpoint holds (transformers drops them when it saves a DeepSeek-V3 or GLM-4.5
    model, though ``num_nextn_predict_layers`` stays in its config)."""
    config = config_from_hf(hf, base)
    m = config.model
    if m.mtp_num_layers > 0:
        with SafetensorsFolder(path) as files:
            present = [k for k in range(m.mtp_num_layers)
                       if f"model.layers.{m.num_layers + k}.eh_proj.weight" in files.names]
        if present != list(range(len(present))):
            raise HFWeightError(f"{path} holds MTP depths {present} of num_nextn_predict_layers={m.mtp_num_layers}; "
                                f"the depths must be the first ones")
        m.mtp_num_layers = len(present)
    return config


def hf_tokenizer(path: PathLike) -> Optional[Path]:
    """The folder's ``tokenizer.json``, or None."""
    file = Path(path) / "tokenizer.json"
    return file if file.is_file() else None


_ARCHITECTURE = {
    "model": ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
              "rope_theta", "norm_eps", "qk_norm", "qkv_bias", "tie_embeddings", "attention", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
              "rope_scaling", "yarn_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
              "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "qk_norm_scope", "partial_rotary_factor",
              "mtp_num_layers", "attention_sinks", "sliding_window", "attention_chunk", "local_attention_layers",
              "rope_layers", "attn_temperature_tuning", "attn_temperature_scale", "attn_temperature_floor",
              "attention_out_bias", "yarn_truncate", "layer_types", "attn_output_gate", "norm_zero_centred",
              "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel", "block", "mla_lora_scale", "mla_norm_eps", "mlp_activation",
              "mamba_num_heads", "mamba_head_dim", "mamba_state_size", "mamba_num_groups", "mamba_conv_kernel",
              "mamba_dt_min"),
    "moe": ("num_experts", "topk", "ffn_hidden_size", "shared_expert_ffn_hidden_size", "shared_expert_gate",
            "score_function", "pre_softmax", "num_groups", "group_topk", "group_score", "scaling_factor", "expert_bias",
            "topk_norm_min", "score_on_input", "router_bias", "expert_linear_bias", "activation", "swiglu_alpha",
            "swiglu_limit", "zero_experts", "latent_size"),
}


def _same_group_ranking(a: Config, b: Config) -> bool:
    """Two group scores that rank groups alike (no groups, or the same number of best
    scores summed: DeepSeek-V3's top-2 sum is Megatron-Core's rule when topk/group_topk = 2)."""
    if a.moe.num_groups is None or b.moe.num_groups is None:
        return a.moe.num_groups == b.moe.num_groups
    return (group_ranked_scores(a.moe.group_score, a.moe.topk, a.moe.group_topk)
            == group_ranked_scores(b.moe.group_score, b.moe.topk, b.moe.group_topk))


def _latent_eps(config: Config) -> float:
    """The epsilon MLA's latent norms use (``model.mla_norm_eps``, null: ``model.norm_eps``)."""
    m = config.model
    return m.norm_eps if m.mla_norm_eps is None else m.mla_norm_eps


def _architecture_mismatch(ours: Config, theirs: Config) -> list[str]:
    out = []
    for section, names in _ARCHITECTURE.items():
        for name in names:
            a, b = getattr(getattr(ours, section), name), getattr(getattr(theirs, section), name)
            if a != b and not (name == "head_dim" and a is None) and not (
                    name == "group_score" and _same_group_ranking(ours, theirs)) and not (
                    name == "mla_norm_eps" and _latent_eps(ours) == _latent_eps(theirs)):
                out.append(f"{section}.{name}: the model has {a!r}, the checkpoint {b!r}")
    if head_dim(ours) != head_dim(theirs):
        out.append(f"head_dim: the model has {head_dim(ours)}, the checkpoint {head_dim(theirs)}")
    if ours.model.num_layers == theirs.model.num_layers and moe_layer_flags(ours) != moe_layer_flags(theirs):
        out.append(f"MoE layers: the model has {moe_layer_flags(ours)}, the checkpoint {moe_layer_flags(theirs)}")
    return out


@torch.no_grad()
def load_hf_into(model: nn.Module, path: PathLike, groups: Optional[ProcessGroups] = None,
                 on_tensor: Optional[Callable[[str, int], None]] = None) -> None:
    """Overwrite this rank's shard of ``model`` (built from ``hf_config(path, ...)``, in the
    layout of ``groups``, default ``model.groups``) with the weights of the Hugging Face
    folder ``path``. Each rank calls it on its own; no collective. ``on_tensor(name,
    numel)`` is called after each parameter (for a progress bar).

    Raises ValueError naming the field or tensor when the checkpoint's architecture,
    tensor names or shapes differ from the model's."""
    groups = groups if groups is not None else model.groups
    config: Config = model.config
    hf = read_hf_config(path)
    family = hf_family(hf)
    mismatch = _architecture_mismatch(config, _checkpoint_config(path, hf, config))
    if mismatch:
        raise HFConfigError(mismatch, f"{path} does not hold the architecture of the model")
    with SafetensorsFolder(path) as files:
        read_sources_into(model, files, weight_sources(config, family, files.names), path, family, groups,
                          on_tensor, ignorable=ignorable_hf_names(config, files.names))


def read_sources_into(model: nn.Module, files: SafetensorsFolder, sources: dict, path: PathLike, family: str,
                      groups: Optional[ProcessGroups] = None,
                      on_tensor: Optional[Callable[[str, int], None]] = None, ignorable: frozenset = frozenset(),
                      keep_buffers: bool = False) -> None:
    """Fill this rank's shard of every parameter of ``model`` from ``sources`` (our name ->
    a Source tree over the tensors of ``files``), reading only the boxes the shard covers.
    Every parameter needs a source, every tensor a source names must exist, and every
    tensor of the folder must be used (or ``ignorable``): raises HFWeightError naming them.
    Persistent buffers (the expert bias) must have a source too, unless ``keep_buffers``
    keeps their initial values. Tensors of pipeline stages other than this rank's are
    named by ``sources`` too (it covers the whole model), so they count as used."""
    groups = groups if groups is not None else model.groups
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state = model.state_dict(keep_vars=True)
    # Persistent buffers: the expert bias (DeepSeek-V3's score correction bias has a source).
    buffers = {} if keep_buffers else {n: state[n] for n in state if n not in aliases}
    missing = sorted(set(params) - set(sources)) + sorted(set(buffers) - set(sources))
    if missing:
        raise HFWeightError(f"the {family} format has no place for the model's {', '.join(missing)}")
    wanted = {n for name in list(params) + list(buffers) for n in sources[name].names()}
    absent = sorted(wanted - files.names)
    if absent:
        raise HFWeightError(f"{path} lacks {len(absent)} tensors the model needs: {', '.join(absent[:6])}"
                            f"{' ...' if len(absent) > 6 else ''}")
    # Under pp a stage reads only its layers; the other stages' tensors have a place too.
    placed = {n for source in sources.values() for n in source.names()}
    unused = sorted(files.names - placed - set(ignorable))
    if unused:
        raise HFWeightError(f"{path} holds tensors the model has no place for (a feature moe-fold does not "
                            f"implement?): {', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''}")
    for name, param in list(params.items()) + list(buffers.items()):
        source = sources[name]
        info = shard_info(param, groups, name) if name in params else buffer_info(param, groups)
        shape = source.shape(files)
        if shape != info.global_shape:
            raise HFWeightError(f"{name}: {', '.join(source.names()[:3])} give global shape {list(shape)}, "
                                f"the model's is {list(info.global_shape)}")
        for piece in info.pieces:
            value = source.read(files, piece.global_, piece.sizes)
            param[box(piece.local, piece.sizes)].copy_(value)
        if on_tensor is not None:
            on_tensor(name, param.numel())


def from_hf(path: PathLike, groups: Optional[ProcessGroups] = None, config: Optional[Config] = None,
            on_tensor: Optional[Callable[[str, int], None]] = None) -> nn.Module:
    """This rank's model with the weights of the Hugging Face folder ``path``
    (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``,
    ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, ``Glm4MoeForCausalLM``,
    ``OlmoeForCausalLM``, ``Ernie4_5_MoeForCausalLM``, ``MiniMaxM2ForCausalLM``,
    ``GptOssForCausalLM``, ``Llama4ForCausalLM``, ``Qwen3NextForCausalLM``, ``Qwen3_5MoeForCausalLM``,
    ``LongcatFlashForCausalLM``).

    Returns the model; its ``.config`` is our :class:`~moe_fold.config.Config` for it.
    ``groups`` (default: one process) is the layout to shard into. ``config`` gives the
    settings that are not the architecture (dispatcher, seq_length, training...); its
    ``parallel`` sizes must match ``groups``. Without it the parallel sizes come from
    ``groups`` (sequence parallel on when tp > 1) and ``model.seq_length`` is the
    checkpoint's ``max_position_embeddings``. Raises
    :class:`~moe_fold.models.hf.config_map.HFConfigError` naming every setting of the
    checkpoint we cannot represent."""
    from moe_fold.models.model import build_model

    groups = groups if groups is not None else ProcessGroups.single_process()
    layout = groups.layout
    config = hf_config(path, config) if config is not None else _with_layout(hf_config(path), layout)
    p = config.parallel
    given = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "ep": p.ep, "etp": p.tp if p.etp is None else p.etp}
    differ = [f"parallel.{k}={v} but the process groups have {k}={layout.sizes[k]}"
              for k, v in given.items() if v != layout.sizes[k]]
    if differ:
        raise ValueError("; ".join(differ))
    validate(config, layout.world_size)
    model = build_model(config, groups)
    load_hf_into(model, path, groups, on_tensor)
    return model


def _with_layout(config: Config, layout) -> Config:
    p = config.parallel
    p.tp, p.cp, p.pp, p.ep, p.etp, p.order = layout.tp, layout.cp, layout.pp, layout.ep, layout.etp, layout.order
    p.sequence_parallel = layout.tp > 1
    return config
