"""Qwen3-MoE (``Qwen3MoeForCausalLM``, docs/families/qwen3-moe.md): a per-head QK-norm
(``self_attn.{q,k}_norm.weight``) on Qwen's layer pattern, no biases, no shared expert."""

from __future__ import annotations

from moe_fold.config import Config

from . import standard
from .base import Family, Keys, Refuse


def from_hf(keys: Keys, config: Config) -> None:
    standard.sizes_from_hf(keys, config, "qwen3_moe", norm_eps=1e-6, theta=1e4, qk_norm=True)
    standard.qwen_layers_from_hf(keys, config, experts_are_dense_wide=False)
    standard.no_attention_bias(keys)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    standard.refusals(config, refuse, "qwen3_moe", qk_norm=True)


def to_hf(config: Config, flags: list) -> dict:
    hf = standard.qwen_to_hf(config, flags)
    hf.update(attention_bias=False)
    return hf


FAMILY = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", features=frozenset(),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.qk_norm, export_priority=80)
