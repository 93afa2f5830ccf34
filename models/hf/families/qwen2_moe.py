"""Qwen2-MoE (``Qwen2MoeForCausalLM``, docs/families/qwen2-moe.md): q|k|v biases
(``qkv_bias``) and a gated shared expert (``shared_expert_intermediate_size``,
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``) on Qwen's layer pattern."""

from __future__ import annotations

from moe_fold.config import Config

from . import standard
from .base import Family, Keys, Refuse


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    standard.sizes_from_hf(keys, config, "qwen2_moe", norm_eps=1e-6, theta=1e4, qk_norm=False)
    standard.qwen_layers_from_hf(keys, config, experts_are_dense_wide=False)
    m.qkv_bias = bool(keys.get("qkv_bias", True))
    shared = keys.get("shared_expert_intermediate_size")
    if shared:
        moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate = int(shared), True


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    standard.refusals(config, refuse, "qwen2_moe", qk_norm=False, qkv_bias_and_shared=True)


def to_hf(config: Config, flags: list) -> dict:
    hf = standard.qwen_to_hf(config, flags)
    hf.update(qkv_bias=config.model.qkv_bias, shared_expert_intermediate_size=config.moe.shared_expert_ffn_hidden_size)
    return hf


FAMILY = Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", features=frozenset(),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.moe.shared_expert_ffn_hidden_size > 0 or config.model.qkv_bias,
    export_priority=90)
