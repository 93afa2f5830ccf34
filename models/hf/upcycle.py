"""Sparse upcycling: start an MoE model from a dense Hugging Face Llama, Qwen2 or Qwen3
checkpoint so that, at step 0, the MoE model computes exactly the dense model's function.

Attention, norms, embeddings and the LM head are copied; dense layers of the MoE model
(``moe.first_k_dense``, ``moe.moe_layer_freq``) copy the dense MLP; every MoE layer's
experts are made from the dense MLP, with ``G = init.upcycle_granularity``:

- ``G = 1`` (plain upcycling): every expert is a copy of the dense MLP. The k routing
  probabilities of a token sum to 1 (``moe.pre_softmax=false``: the softmax over the k
  chosen logits; or sigmoid scores normalised over the k), so the layer's output,
  ``sum_i p_i * MLP(x)``, is ``MLP(x)`` whatever the router says: it starts random.
- ``G > 1`` (granular upcycling, fine-grained experts of width F/G): the MLP's ffn is cut
  into G slices, and since SwiGLU acts column by column, ``MLP(x)`` is the sum of the G
  slice-MLPs. Experts are laid out in E/G groups of G consecutive experts, expert ``e``
  holding slice ``e % G``, and every expert of a group gets the same router row, so a
  group's experts tie in the router and the top-k (k a multiple of G) always takes whole
  groups. The k probabilities sum to 1 and are equal within a group, so the chosen
  groups' shares ``p_g`` sum to 1/G; with each expert's fc2 scaled by G the layer is
  ``sum_g p_g * G * MLP(x) = MLP(x)`` (the virtual-group initialisation of He et al. 2024,
  "Upcycling Large Language Models into Mixture of Experts").

Every rank reads only the slices of the safetensors files its shard of each parameter
needs, as :func:`moe_fold.models.hf.importer.load_hf_into` does.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import nn

from moe_fold.config import Config, head_dim, moe_layer_flags, require, upcycle_slices
from moe_fold.layout import ProcessGroups

from .families.base import METADATA_KEYS, HFConfigError, Keys, check_window, rope_theta, swiglu
from .importer import hf_tokenizer, read_hf_config, read_sources_into
from .sources import Cat, SafetensorsFolder, Source, Stack, Take
from .weights import ignorable_hf_names

__all__ = ["DENSE_FAMILIES", "upcycled_config", "upcycle_sources", "load_upcycled_into"]

# model_type -> the dense causal-LM class that writes it
DENSE_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_T = (1, 0)  # Hugging Face [out, in] <-> our expert layout [in, out]


def _dense_family(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type not in DENSE_FAMILIES:
        raise HFConfigError([f"model_type={model_type!r} is not a dense family that can be upcycled: one of "
                             f"{', '.join(DENSE_FAMILIES)}"], "cannot upcycle")
    archs = hf.get("architectures")
    if archs is not None and list(archs) != [DENSE_FAMILIES[model_type]]:
        raise HFConfigError([f"architectures={archs!r}: only [{DENSE_FAMILIES[model_type]!r}] is supported for "
                             f"model_type={model_type!r}"], "cannot upcycle")
    return model_type


def upcycled_config(path: Union[str, os.PathLike], base: Config) -> Config:
    """``base`` with the architecture of the dense Hugging Face model at ``path`` and MoE
    layers upcycled from its MLP: ``moe.num_experts``, ``moe.topk``, the layer pattern and
    the routing stay ``base``'s; ``moe.ffn_hidden_size`` becomes the dense ffn divided by
    ``init.upcycle_granularity``. Raises :class:`HFConfigError` naming every key of the
    dense config that cannot be represented and every setting under which the upcycled
    model would not compute the dense model's function."""
    hf = read_hf_config(path)
    family = _dense_family(hf)
    problems: list[str] = []
    keys = Keys(hf, family, problems)
    config = copy.deepcopy(base)
    config.init.upcycle_from = str(path)
    m, moe = config.model, config.moe
    m.vocab_size = keys.get("vocab_size")
    m.hidden_size = keys.get("hidden_size")
    m.num_layers = keys.get("num_hidden_layers")
    m.num_heads = keys.get("num_attention_heads")
    m.num_kv_heads = keys.get("num_key_value_heads", m.num_heads)
    m.ffn_hidden_size = keys.get("intermediate_size")
    if None in (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.ffn_hidden_size):
        raise HFConfigError(problems, f"cannot upcycle {family} config")
    explicit_head_dim = keys.get("head_dim", None)
    m.head_dim = int(explicit_head_dim) if explicit_head_dim is not None else m.hidden_size // m.num_heads
    m.norm_eps = float(keys.get("rms_norm_eps", 1e-6))
    m.tie_embeddings = bool(keys.get("tie_word_embeddings", False))
    m.init_std = float(keys.get("initializer_range", 0.02))
    m.rope_theta = rope_theta(keys, 1e4)
    m.qk_norm, m.qkv_bias = family == "qwen3", family == "qwen2"
    keys.must_be("hidden_act", ("silu",), "the MLPs and experts are SwiGLU (silu)")
    keys.must_be("attention_dropout", (0.0, 0), "attention has no dropout here")
    keys.must_be("mlp_bias", (False,), "the MLPs have no biases here")
    keys.must_be("is_encoder_decoder", (False,), "the model is a decoder only")
    if family in ("llama", "qwen3"):
        keys.must_be("attention_bias", (False,), "attention projections have no biases here")
    if family == "llama":
        keys.must_be("pretraining_tp", (1,), "pretraining_tp > 1 changes Llama's matmul rounding only in "
                                             "transformers; it must be 1")
    else:
        sliding = bool(keys.get("use_sliding_window", False))
        keys.get("max_window_layers", None)
        layer_types = keys.get("layer_types", None)
        if layer_types is not None:
            sliding = sliding and "sliding_attention" in layer_types
        check_window(keys, m.seq_length, sliding_layers=sliding)
    keys.used |= {"problem_type"} | METADATA_KEYS
    unknown = keys.unknown()
    if unknown:
        problems.append(f"{', '.join(unknown)}: not understood by moe-fold's {family} upcycler "
                        f"(a setting it cannot represent is refused rather than ignored)")
    granularity = config.init.upcycle_granularity
    problems += _function_preserving_problems(config, granularity)
    if not problems:
        moe.ffn_hidden_size = m.ffn_hidden_size // granularity
        moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = 0, False
    if problems:
        raise HFConfigError(problems, f"cannot upcycle {path} ({family})")
    if config.data.tokenizer == "byte" and hf_tokenizer(path) is not None:
        config.data.tokenizer = str(path)  # tokenize the data with the model's own vocabulary
    return config


def _function_preserving_problems(config: Config, granularity: int) -> list[str]:
    """The settings under which the upcycled model would not compute the dense model's
    function at step 0, one line each (field, value, rule)."""
    m, moe = config.model, config.moe
    out = upcycle_slices(granularity)
    if out:
        return out
    if m.ffn_hidden_size % granularity:
        out.append(f"init.upcycle_granularity={granularity} must divide the dense intermediate_size="
                   f"{m.ffn_hidden_size} (each expert is one slice of the MLP's ffn)")
    if moe.num_experts % granularity:
        out.append(f"moe.num_experts={moe.num_experts} is not divisible by init.upcycle_granularity={granularity} "
                   f"(experts come in groups holding every slice once)")
    if moe.topk % granularity:
        out.append(f"moe.topk={moe.topk} is not divisible by init.upcycle_granularity={granularity} (the top-k "
                   f"must take whole groups of slices for the layer to equal the dense MLP)")
    if moe.score_function == "softmax" and moe.pre_softmax and moe.topk < moe.num_experts:
        out.append("moe.pre_softmax=true: the top-k of the full softmax does not sum to 1, so the upcycled layer "
                   "would scale the dense MLP; upcycle with moe.pre_softmax=false")
    if moe.score_function == "sigmoid" and moe.topk == 1:
        out.append("moe.score_function=sigmoid with moe.topk=1: a single sigmoid score is not normalised, so the "
                   "upcycled layer would scale the dense MLP")
    if moe.scaling_factor not in (None, 1, 1.0):
        out.append(f"moe.scaling_factor={moe.scaling_factor} scales the routed output; upcycling needs none")
    if moe.num_groups is not None and granularity > 1:
        out.append(f"moe.num_groups={moe.num_groups} with init.upcycle_granularity={granularity}: group-limited "
                   f"routing can split a group of slices")
    if moe.capacity_factor is not None:
        out.append(f"moe.capacity_factor={moe.capacity_factor}: dropped tokens would skip the MLP; upcycle "
                   f"dropless (capacity_factor unset)")
    if moe.shared_expert_ffn_hidden_size:
        out.append(f"moe.shared_expert_ffn_hidden_size={moe.shared_expert_ffn_hidden_size}: the dense MLP becomes "
                   f"the routed experts; an upcycled model has no shared expert")
    if moe.zero_experts:
        out.append(f"moe.zero_experts={moe.zero_experts}: a slot on a zero expert returns the token, not the "
                   f"dense MLP; upcycle without zero experts")
    if moe.latent_size is not None:
        out.append(f"moe.latent_size={moe.latent_size}: latent experts cannot hold the dense MLP's hidden-width "
                   f"slices; upcycle without a latent MoE")
    return out


@dataclass(frozen=True)
class Narrow:
    """``part`` narrowed to ``length`` entries from ``start`` along ``dim``."""

    part: Source
    dim: int
    start: int
    length: int

    def names(self) -> list[str]:
        return self.part.names()

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = list(self.part.shape(hf))
        shape[self.dim] = self.length
        return tuple(shape)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        off = list(offsets)
        off[self.dim] += self.start
        return self.part.read(hf, tuple(off), sizes)


@dataclass(frozen=True)
class Scaled:
    """``part`` times ``factor``."""

    part: Source
    factor: float

    def names(self) -> list[str]:
        return self.part.names()

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        return self.part.shape(hf)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return self.part.read(hf, offsets, sizes) * self.factor


@dataclass(frozen=True)
class Given:
    """A tensor made here rather than read (the router of an upcycled layer)."""

    value: torch.Tensor
    label: str

    def names(self) -> list[str]:
        return []

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return self.value[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def _router(config: Config, layer: int, granularity: int) -> torch.Tensor:
    """``[E, H]``: one random row per group of ``granularity`` experts, repeated over the
    group (drawn from ``train.seed`` and the layer, the same on every rank)."""
    m, moe = config.model, config.moe
    gen = torch.Generator().manual_seed(config.train.seed * 1000003 + layer)
    rows = torch.randn(moe.num_experts // granularity, m.hidden_size, generator=gen) * m.init_std
    return rows.repeat_interleave(granularity, dim=0)  # [E/G, H] -> [E, H]


def upcycle_sources(config: Config) -> dict[str, Source]:
    """Our parameter name -> where it comes from in the dense checkpoint, for a model of
    ``config`` (from :func:`upcycled_config`)."""
    m, moe = config.model, config.moe
    granularity = config.init.upcycle_granularity
    hd = head_dim(config)
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    width = m.ffn_hidden_size // granularity
    out: dict[str, Source] = {"embed.weight": Take("model.embed_tokens.weight"), "norm.weight": Take("model.norm.weight")}
    if not m.tie_embeddings:
        out["lm_head.weight"] = Take("lm_head.weight")
    for i, is_moe in enumerate(moe_layer_flags(config)):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = f"{hf}self_attn.", f"{hf}mlp."
        out[f"{ours}attn_norm.weight"] = Take(f"{hf}input_layernorm.weight")
        out[f"{ours}mlp_norm.weight"] = Take(f"{hf}post_attention_layernorm.weight")
        out[f"{ours}attn.qkv.weight"] = Cat(0, tuple(Take(f"{attn}{p}_proj.weight") for p in "qkv"), (q, kv, kv))
        if m.qkv_bias:
            out[f"{ours}attn.qkv.bias"] = Cat(0, tuple(Take(f"{attn}{p}_proj.bias") for p in "qkv"), (q, kv, kv))
        out[f"{ours}attn.proj.weight"] = Take(f"{attn}o_proj.weight")
        if m.qk_norm:
            out[f"{ours}attn.q_norm.weight"] = Take(f"{attn}q_norm.weight")
            out[f"{ours}attn.k_norm.weight"] = Take(f"{attn}k_norm.weight")
        if not is_moe:
            out[f"{ours}mlp.fc1.weight"], out[f"{ours}mlp.fc2.weight"] = swiglu(
                mlp, "gate_proj", "up_proj", "down_proj", m.ffn_hidden_size)
            continue
        out[f"{ours}mlp.router.weight"] = Given(_router(config, i, granularity), f"{ours}mlp.router.weight")
        fc1, fc2 = [], []
        for e in range(moe.num_experts):
            start = (e % granularity) * width
            gate = Narrow(Take(f"{mlp}gate_proj.weight", _T), 1, start, width)  # [H, F] -> [H, F/G]
            up = Narrow(Take(f"{mlp}up_proj.weight", _T), 1, start, width)
            fc1.append(Cat(1, (gate, up), (width, width)))
            down = Narrow(Take(f"{mlp}down_proj.weight", _T), 0, start, width)  # [F, H] -> [F/G, H]
            fc2.append(down if granularity == 1 else Scaled(down, float(granularity)))
        out[f"{ours}mlp.experts.fc1"], out[f"{ours}mlp.experts.fc2"] = Stack(tuple(fc1)), Stack(tuple(fc2))
    return out


@torch.no_grad()
def load_upcycled_into(model: nn.Module, path: Union[str, os.PathLike], groups: Optional[ProcessGroups] = None,
                       on_tensor: Optional[Callable[[str, int], None]] = None) -> None:
    """Overwrite this rank's shard of ``model`` (built from :func:`upcycled_config`) with the
    upcycled weights of the dense Hugging Face folder ``path``. Each rank calls it on its
    own; no collective."""
    config: Config = model.config
    require(upcycle_slices, config.init.upcycle_granularity)
    _dense_family(read_hf_config(path))
    with SafetensorsFolder(path) as files:
        # The expert bias (sigmoid routing) starts at zero, as in any new run.
        read_sources_into(model, files, upcycle_sources(config), path, "dense", groups, on_tensor,
                          ignorable=ignorable_hf_names(config, files.names), keep_buffers=True)
